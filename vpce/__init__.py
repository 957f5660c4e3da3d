"""vpce: exact vocab-parallel fused linear + cross-entropy that never materializes [tokens, vocab] logits.

Layout (docs/design.md has the map): ``api``, ``distill`` and ``post_training`` (the public functions and their
option checks), ``nn`` (torch's ``linear_cross_entropy`` / ``LinearCrossEntropyLoss`` signatures on vpce),
``prepare`` (call preparation under them: checks, autocast, the route, the agreement), ``routing`` and
``speculation`` (the plan of a call: route and sizes), ``autograd`` (the autograd shells), ``backends`` (the engine:
``backends.triton``, its chunk and block loops and one module per loss family, and ``backends.pytorch``, the CPU
path; the GEMM dispatch ``backends.gemm`` and the gradient hand-back ``backends.grads``), ``kernels`` (the GPU
kernels, one module per family), ``formulas`` (the per-row formulas, one module per family), ``rank_stats`` (the
softmax statistics and their combine across ranks), ``parallel`` (the agreement between ranks, shard ranges, the
statistics exchange, autograd-aware collectives), ``reference`` (the float64 reference), ``bench``
(``python -m vpce.bench``).
"""

from . import nn
from .api import CrossEntropyOutput, LinearCrossEntropy, linear_cross_entropy, linear_log_probs
from .backends.gemm import HopperExtraWarning
from .backends.hopper import build as build_hopper_kernels
from .options import LossOptions

__all__ = ["linear_cross_entropy", "linear_log_probs", "LinearCrossEntropy", "LossOptions", "CrossEntropyOutput", "nn",
           "HopperExtraWarning", "build_hopper_kernels"]

from .distill import linear_distillation_loss  # noqa: E402

__all__ += ["linear_distillation_loss"]

from .post_training import (DPOOutput, GRPOOutput, high_entropy_mask, linear_dpo_loss, linear_grpo_loss,  # noqa: E402
                            linear_log_prob_loss, vllm_importance_sampling_ratio)

__all__ += ["linear_log_prob_loss", "linear_grpo_loss", "GRPOOutput", "linear_dpo_loss", "DPOOutput",
            "vllm_importance_sampling_ratio", "high_entropy_mask"]

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("vpce")  # the installed distribution's: pyproject.toml's `version`
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never pip-installed
    __version__ = "0+unknown"
