"""Triton kernels, one module per family; every launcher is re-exported here (``kernels.logits_tiles``, ...).

* ``softmax``: the cross-entropy's and log-probs' kernels: the lm_head GEMM with a softmax epilogue
  (``logits_tiles``), the same epilogue over logits cuBLAS already wrote (``stored_logits``), the exact target
  logit, the per-row reduction of the tile statistics and the combine of every rank's statistics;
* ``gated``: the one-pass scale-and-cast of an fp32 accumulator, and the speculative route's kernels gated by a
  device flag;
* ``distill``: the distillation's bandwidth-bound passes over both heads' stored logits;
* ``epilogue``: not Triton but CuTe (quack's epilogue DSL, the ``hopper`` extra): the statistics epilogue of the
  fast route's logits GEMM (``stats_epilogue``, launched by ``vpce.backends.gemm.logits_with_stats``);
* ``common``: what they share (the fast ``exp``, the soft cap, a program's tile, the persistent grid);
* ``launch``: ``first_launch``, which every kernel is declared with: a cold process's first launch of it builds
  Triton's C launcher beside the kernel's compile.

Everything is deterministic (plain stores, no atomics) and runs under ``TRITON_INTERPRET=1`` on the CPU. The
kernels import nothing of vpce but ``vpce.rank_stats.RankStats`` (what the combine returns).
"""

from .common import INTERPRET
from .distill import combine_distill_heads, distill_block_align, distill_grad_, distill_mixture, distill_stats
from .gated import gated_scale_, gated_weight_grad_, row_scale_cast, scale_cast
from .softmax import (combine_rank_stats, grad_metrics, logits_tiles, reduce_tiles, stored_logits, target_logits,
                      target_out_of_lse, tile_n)

__all__ = ["logits_tiles", "stored_logits", "target_logits", "target_out_of_lse", "grad_metrics", "reduce_tiles",
           "combine_rank_stats", "scale_cast", "row_scale_cast", "gated_weight_grad_", "gated_scale_", "tile_n",
           "INTERPRET", "distill_stats", "combine_distill_heads", "distill_mixture", "distill_grad_",
           "distill_block_align"]
