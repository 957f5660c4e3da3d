"""The Triton backend: the engine (``engine``: the chunk loop and the block loop) and one module per loss family,
mirroring ``vpce.kernels``: ``softmax`` (cross-entropy, log-probs, a loss of the log-probs, the speculative
route's backward) and ``distill`` (the distillation). Its functions, the same names as ``vpce.backends.pytorch``'s,
are re-exported here; ``vpce.autograd.backend_module`` picks one of the two."""

from ... import kernels
from .distill import distill_forward, distill_recompute_grads
from .softmax import cross_entropy, log_prob_loss, log_probs, log_probs_formed, recompute_grads, speculative_grads

__all__ = ["cross_entropy", "log_probs", "log_probs_formed", "log_prob_loss", "recompute_grads", "speculative_grads",
           "scale_cast", "distill_forward", "distill_recompute_grads"]

scale_cast = kernels.scale_cast
