#!/bin/bash
# call A: quack's first part and wheels -> /tmp/quack (no GPU work)
mkdir -p /tmp/quack/wheels && cp .scratch/qc1/cu13.tar.xz.part-aa /tmp/quack/ && cp .scratch/qc2/wheels/*.whl /tmp/quack/wheels/
nvidia-smi --query-gpu=name --format=csv,noheader
