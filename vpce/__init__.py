"""vpce: exact vocab-parallel fused linear + cross-entropy that never materializes [tokens, vocab] logits.

Layout (docs/design.md has the map): ``api``, ``distill`` and ``post_training`` (the public functions and their
option checks), ``prepare`` (call preparation under them: checks, autocast, the route, the agreement), ``routing``
(the plan of a call: route and sizes), ``parallel`` (the agreement between ranks, shard ranges, statistics exchange,
autograd-aware collectives), ``autograd`` (the autograd shells), ``torch_backend`` (pure-PyTorch chunked backend,
the CPU path), ``triton_backend`` and ``kernels`` (fused GPU kernels), ``reference`` (the float64 reference),
``nn`` (torch's ``linear_cross_entropy`` / ``LinearCrossEntropyLoss`` signatures on vpce), ``bench``
(``python -m vpce.bench``).
"""

from . import nn
from .api import CrossEntropyOutput, LinearCrossEntropy, linear_cross_entropy, linear_log_probs
from .options import LossOptions

__all__ = ["linear_cross_entropy", "linear_log_probs", "LinearCrossEntropy", "LossOptions", "CrossEntropyOutput", "nn"]

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
