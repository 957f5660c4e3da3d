#!/bin/bash
mkdir -p /tmp/quack && cp .dev/q1/*.part-* /tmp/quack/ && ls -la /tmp/quack && nvidia-smi --query-gpu=name --format=csv,noheader
