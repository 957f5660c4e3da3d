#!/bin/bash
# the tree under .dev/trees/ that this session's calls compared against (from the checkout's root): base = 28d61aa
# (main at the session's start); "new" is the working tree itself
set -e
R=.dev/trees; rm -rf $R; mkdir -p $R/base
git archive 28d61aa vpce launch tests pyproject.toml | tar -x -C $R/base
