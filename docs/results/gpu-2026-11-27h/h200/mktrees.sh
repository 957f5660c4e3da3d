#!/bin/bash
# rebuild .scratch/qc13/trees from the commits: main and cap-lean (cl)
set -e
cd "$(git rev-parse --show-toplevel)"
T=.scratch/qc13/trees; rm -rf $T; mkdir -p $T/main $T/cl $T/fw
git archive main vpce launch tests pyproject.toml | tar -x -C $T/main
git archive cap-lean vpce launch tests pyproject.toml | tar -x -C $T/cl
git archive frozen-whole-2 vpce launch tests pyproject.toml | tar -x -C $T/fw
echo "main=$(git rev-parse --short main) cl=$(git rev-parse --short cap-lean) fw=$(git rev-parse --short frozen-whole-2)" > .scratch/qc13/commit.txt
cat .scratch/qc13/commit.txt; du -sh .scratch/qc13
