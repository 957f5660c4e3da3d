"""Without CUDA, Triton kernels run through Triton's CPU interpreter (set before any kernel module is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
