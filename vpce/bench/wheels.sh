#!/usr/bin/env bash
# Download the peer libraries that `python -m vpce.bench` compares against, as wheels for the GPU machine
# (CPython 3.12, manylinux x86_64), into .whl/ at the repository root (git-ignored):
#
#   bash vpce/bench/wheels.sh            # here, where PyPI is reachable
#
# and on the GPU machine, which has no network, install them without resolving dependencies:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Their Requires-Dist (`unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist`, extras left out):
#   liger-kernel 0.8.5       torch>=2.1.2, triton>=2.3.1
#   cut-cross-entropy 25.1.1 torch, triton (Linux)
#   megatron-core 0.19.2     torch>=2.6.0, numpy, packaging>=24.2; Requires-Python >=3.12 (so not the test extra's
#                            pin, 0.16.1, which the CPU suite's Python 3.11 keeps)
#   fla-core 0.6.0           einops (its torch>=2.7 and triton>=3.3 are in its extras only): einops 0.8.2 fetched
# the rest already in the GPU image (torch 2.11, triton 3.6, numpy, packaging), so --no-deps needs nothing else.
# The CuTe DSL rows of liger-kernel (liger-cute; liger-logprob-loss's and liger-verl's sm_90 kernel) need its
# `cutedsl` extra, nvidia-cutlass-dsl>=4.6.0 and apache-tvm-ffi>=0.1.0: the wheels of launch/quack_wheels.sh
# (nvidia-cutlass-dsl 4.7.1, apache-tvm-ffi 0.1.15.post2), installed beside these. Without them liger-cute and,
# on an sm_90 GPU, liger-logprob-loss and liger-verl are `missing`. The native CUTLASS + NVSHMEM path of its
# tensor-parallel function needs liger-cute-kernels (its `lck` extra), which PyPI does not serve: under --tp the
# liger rows take its 512-token fallback (their note says so).
#   trl 1.16.0 (the trl and trl-sft rows: trl.kernels.chunked_logprob, which imports transformers.utils) and what
#   importing that takes, found by importing it with nothing else on the path: transformers 5.23.0,
#   huggingface-hub 2.4.0, regex, tqdm, pyyaml, safetensors (checked at transformers' import), httpx2, httpcore2,
#   h11, idna, truststore (imported by huggingface-hub). Not pandas, accelerate or datasets: the row's backward
#   imports trl.trainer.utils, and without them vpce.bench.peers.trl stands in for its one function used there.
# megatron-core warns at import that Transformer Engine and Apex are missing; neither is used by the rows.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]/#/--platform=}" -d "$dest" \
    liger-kernel==0.8.5 cut-cross-entropy==25.1.1 megatron-core==0.19.2 fla-core==0.6.0 einops==0.8.2 \
    trl==1.16.0 transformers==5.23.0 huggingface-hub==2.4.0 regex==2026.11.15 tqdm==4.70.1 pyyaml==6.0.3 \
    safetensors==0.8.0 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 idna==3.20 truststore==0.10.5
ls -l "$dest"
