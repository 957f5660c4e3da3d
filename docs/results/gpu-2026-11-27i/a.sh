#!/bin/bash
# call A: the cu13 wheel's first and last parts -> /tmp/quack (no GPU work)
mkdir -p /tmp/quack && cp .dev/q1/* /tmp/quack/ && ls -la /tmp/quack && nvidia-smi --query-gpu=name --format=csv,noheader
