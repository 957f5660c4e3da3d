"""Session 12 experiment (not in the package): the distillation fast route with the teacher's logit buffer in fp32
(cuBLAS writes fp32; the student's stays in the inputs' dtype and takes the gradient in place). argv[1]: mode
'fp32t' | 'bf16'; argv[2]: FAST_GIB; the rest: python -m vpce.bench arguments."""
import sys

import torch

import vpce.distill_triton as dt
from vpce.gemm import mm_into

mode, gib = sys.argv[1], float(sys.argv[2])
dt.FAST_GIB = gib
if mode == "fp32t":
    orig_buffer, orig_logits, calls = dt._buffer, dt.logits_into, [0]

    def _buffer(numel, dtype, device):
        calls[0] += 1
        return orig_buffer(numel, torch.float32 if calls[0] % 2 == 0 else dtype, device)

    def logits_into(out, h, w, b):
        if out.dtype != h.dtype:
            assert b is None
            return mm_into(out, h, w.t())
        return orig_logits(out, h, w, b)
    dt._buffer, dt.logits_into = _buffer, logits_into
from vpce.bench.cli import main
sys.exit(main(sys.argv[3:]))
