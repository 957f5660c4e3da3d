"""vpce: exact vocab-parallel fused linear + cross-entropy that never materializes [tokens, vocab] logits.

Layout: ``api`` (public function and module, argument checks), ``parallel`` (shard ranges, statistics
exchange, autograd-aware collectives), ``torch_backend`` (pure-PyTorch chunked backend, the CPU path),
``triton_backend`` (fused GPU kernels), ``bench`` (``python -m vpce.bench``).
"""

from .api import LinearCrossEntropy, linear_cross_entropy, linear_log_probs
from .options import LossOptions

__all__ = ["linear_cross_entropy", "linear_log_probs", "LinearCrossEntropy", "LossOptions"]

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("vpce")  # the installed distribution's: pyproject.toml's `version`
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never pip-installed
    __version__ = "0+unknown"
