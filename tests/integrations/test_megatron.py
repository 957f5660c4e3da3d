"""vpce against real megatron-core on the same shards (gloo ranks): same per-token loss and gradients.

Megatron's path is its own: the hidden states enter the tensor-parallel region through megatron's mappings
(``copy_to_tensor_model_parallel_region``, or ``gather_from_sequence_parallel_region`` with sequence
parallelism; torch's autograd all-gather on CPU), the shard's logits are materialized, and ``vocab_parallel_cross_entropy`` gives the per-token
loss. Compared where megatron-core is exact: equal shards, no padding, no label smoothing (megatron smooths over
the partition's vocab). megatron-core casts the logits to fp32, so even from float64 inputs it is exact to fp32
rounding: the bound is 2e-6 (vpce itself matches the float64 oracle to 1e-11 in test_distributed).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.nn.functional import all_gather

import vpce
from distributed import run_ranks
from vpce.reference import rel_err
from problems import leaf, make_problem

pytest.importorskip("megatron.core")


def _megatron_main(rank, world, sequence_parallel):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings, vocab_parallel_cross_entropy

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    group = ps.get_tensor_model_parallel_group()
    rows = 29
    seq, batch = 5 * world, 3
    p = make_problem((seq, batch), 24, rows * world, dtype=torch.float64, reduction="none", ignore_frac=0.0,
                     seed=11)
    hidden = p.hidden[rank * 5:(rank + 1) * 5] if sequence_parallel else p.hidden
    w_shard = p.weight[rank * rows:(rank + 1) * rows]

    h_m, w_m = leaf(hidden), leaf(w_shard)
    if sequence_parallel:
        # megatron's gather_from_sequence_parallel_region allocates on CUDA; torch's autograd-aware all-gather
        # does the same thing on CPU (its backward sums each slice's gradient over the ranks)
        full = torch.cat(all_gather(h_m, group=group), dim=0)
    else:
        full = mappings.copy_to_tensor_model_parallel_region(h_m)
    loss_m = vocab_parallel_cross_entropy(F.linear(full, w_m), p.target)
    loss_m.backward(p.grad)

    h_v, w_v = leaf(hidden), leaf(w_shard)
    loss_v = vpce.linear_cross_entropy(h_v, w_v, p.target, group=group, sequence_parallel=sequence_parallel,
                                       reduction="none")
    loss_v.backward(p.grad)
    ps.destroy_model_parallel()
    return rel_err(loss_v, loss_m), rel_err(h_v.grad, h_m.grad), rel_err(w_v.grad, w_m.grad)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence-parallel"])
def test_same_as_megatron_vocab_parallel_cross_entropy(world, sequence_parallel):
    for rank, (loss_err, dx_err, dw_err) in enumerate(run_ranks(_megatron_main, world, sequence_parallel)):
        where = f"rank {rank} of {world}, sp={sequence_parallel}"
        assert loss_err < 2e-6, f"{where}: per-token loss differs from megatron-core by {loss_err:.2e}"
        assert dx_err < 2e-6, f"{where}: dX differs from megatron-core by {dx_err:.2e}"
        assert dw_err < 2e-6, f"{where}: dW shard differs from megatron-core by {dw_err:.2e}"
