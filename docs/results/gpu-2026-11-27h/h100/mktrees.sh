#!/bin/bash
# rebuild .scratch/qc14/trees from the commits: grad-bm8 (b8) and next8 (n8)
set -e
cd "$(git rev-parse --show-toplevel)"
T=.scratch/qc14/trees; rm -rf $T; mkdir -p $T/b8 $T/n8
git archive grad-bm8 vpce launch tests pyproject.toml | tar -x -C $T/b8
git archive next8 vpce launch tests pyproject.toml README.md CHANGELOG.md Makefile docs/api.md docs/design.md docs/benchmarks.md docs/integrations.md | tar -x -C $T/n8
echo "b8=$(git rev-parse --short grad-bm8) n8=$(git rev-parse --short next8)" > .scratch/qc14/commit.txt
cat .scratch/qc14/commit.txt; du -sh .scratch/qc14
