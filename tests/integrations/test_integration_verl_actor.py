"""verl 0.9.1's actor update with ``vpce.integrations.verl.apply()`` against verl's own, on CPU.

Both run verl's FSDP engine code (``FSDPEngineWithLMHead.forward_backward_batch``: micro-batches, its
``prepare_model_inputs`` / ``prepare_model_outputs``, its ``ppo_loss`` as the worker's loss function, the backward)
on a tiny Llama built from a config and sharded with FSDP2 over 2 gloo ranks (data parallel: each rank its own
responses, the loss scaled by verl's global token and sequence counts). verl's side computes the logits (float64,
the oracle) and its loss on their log-probs; vpce's side is the same model with verl's fused-kernel forward (its
``patch_forward_with_backends``) after ``apply()``: the policy loss is formed in the model's forward. Compared: each
micro-batch's loss, verl's metrics, every parameter's gradient, and the no-grad log-probs and entropy of
``infer_batch`` (verl's ``compute_log_prob``) at the response positions, as verl's trainer takes them (without
remove-padding, verl's own fused and unfused forwards differ at each sequence's last position, which predicts
nothing).

Not run here: the engine's construction (``FSDPEngine.__init__`` / ``initialize`` build the device mesh and FSDP
module for CUDA; the test sets the attributes that the forward step reads and shards the model itself), the
optimizer step, and verl's ``get_device_id`` (pointed at the CPU).
"""

import functools

import pytest
import torch

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl 0.9.x (needs ray and tensordict)")

from distributed import run_ranks  # noqa: E402
from test_post_training import CUDA, check  # noqa: E402

V, P, R = 97, 5, 6  # vocab, prompt and response width (left / right padded)
CASES = {  # id: (loss mode, aggregation, remove padding, dtype, tolerance)
    "vanilla-token-mean": ("vanilla", "token-mean", True, torch.float64, 1e-10),
    "vanilla-seq-mean-token-sum-padded": ("vanilla", "seq-mean-token-sum", False, torch.float64, 1e-10),
    "gspo-seq-mean-token-mean": ("gspo", "seq-mean-token-mean", True, torch.float64, 1e-10),
    "clip_cov-token-mean": ("clip_cov", "token-mean", True, torch.float64, 1e-10),
    "vanilla-token-mean-float32": ("vanilla", "token-mean", True, torch.float32, 2e-5),
}


def _models(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    class FusedLlama(LlamaForCausalLM):  # its own class: verl's patch replaces the class's forward
        pass

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).to(dtype)
    fused = FusedLlama(cfg).to(dtype)
    fused.load_state_dict(base.state_dict())
    patch_forward_with_backends(fused, use_fused_kernels=True, fused_kernels_backend="torch")
    return base, fused


def _full(grad):
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).double()


def _engine(model, shard):
    """verl's FSDP engine with an LM head, holding ``model`` (with ``shard``, wrapped by FSDP2 over the world)."""
    import verl.utils.torch_functional as verl_F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if shard:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.engine_config = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False)
    engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size, engine.ulysses_device_mesh = False, 1, None
    engine.pad_to_length, engine._autocast_dtype, engine.scaler = False, torch.float32, None  # no autocast
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    engine.module = model
    return engine


def _batch(rank, dtype, remove_padding, fused, train=True):
    """verl's update batch: left-padded prompts, right-padded responses, one masked token inside a response,
    converted by verl's ``left_right_2_no_padding``; the keys its trainer and worker add."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(10 + rank)
    b = 4
    plen, rlen = torch.tensor([5, 3, 4, 2]).roll(rank), torch.tensor([6, 4, 2, 5]).roll(rank)
    ids = torch.randint(0, V, (b, P + R), generator=g)
    attn = torch.zeros(b, P + R, dtype=torch.long)
    for i in range(b):
        attn[i, P - plen[i]:P + rlen[i]] = 1
    response_mask = attn[:, P:].to(dtype)
    response_mask[rank, 1] = 0
    td = TensorDict({"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
                     "prompts": ids[:, :P], "responses": ids[:, P:], "response_mask": response_mask,
                     "old_log_probs": -torch.rand(b, R, generator=g, dtype=dtype) * 2 - 3.8,
                     "advantages": torch.randn(b, R, generator=g, dtype=dtype),
                     "ref_log_prob": -torch.rand(b, R, generator=g, dtype=dtype) * 2 - 3.8}, batch_size=[b])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=0.5, calculate_entropy=True, global_batch_size=b * 2,
                         use_remove_padding=remove_padding, use_fused_kernels=fused, micro_batch_size_per_gpu=2,
                         use_dynamic_bsz=False, compute_loss=train)
    return td


def _actor_config(loss_mode, agg):
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg,
                       entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl",
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode))


def _metrics(metrics):
    from verl.utils.metric import Metric

    return {k: [float(x) for x in (v.values if isinstance(v, Metric) else v)] for k, v in metrics.items()}


def _numpy(tree):  # tensors cross the process boundary as arrays (a shared tensor dies with its rank)
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    return tree.detach().numpy() if isinstance(tree, torch.Tensor) else tree


def _update(rank, world, cases, shard):
    import warnings

    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    import vpce.integrations.verl as vverl

    fsdp_impl.get_device_id = fsdp_impl.get_device_name = lambda: "cpu"  # verl looks for an accelerator
    vverl.apply(backend="torch")
    fused_calls = []  # the micro-batches whose loss vpce's head formed (the fused route, not a fallback)
    head = vverl._FusedStep.head
    vverl._FusedStep.head = lambda step, *a: fused_calls.append(1) or head(step, *a)
    results = {}
    for case in cases:
        loss_mode, agg, remove_padding, dtype, _ = CASES[case]
        out = {}
        for side, model in zip(("verl", "vpce"), _models(dtype)):
            engine = _engine(model, shard)
            loss_fn = functools.partial(ppo_loss, config=_actor_config(loss_mode, agg))
            torch.manual_seed(1)  # clip_cov draws a random subset of tokens: the same draw on both sides
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="vpce.integrations.verl")  # no fallback
                train = engine.forward_backward_batch(_batch(rank, dtype, remove_padding, side == "vpce"), loss_fn)
                grads = {n: _full(p.grad) for n, p in model.named_parameters()}
                data = _batch(rank, dtype, remove_padding, side == "vpce", train=False)
                infer = engine.infer_batch(data)
            out[side] = dict(
                loss=torch.tensor(train["loss"], dtype=torch.float64), metrics=_metrics(train["metrics"]), grads=grads,
                # as verl's trainer takes them (_compute_old_log_prob): the response positions, [B, R]
                log_probs=no_padding_2_padding(infer["model_output"]["log_probs"], data).double(),
                entropy=no_padding_2_padding(infer["model_output"]["entropy"], data).double())
            out[side]["fused"] = len(fused_calls)
            fused_calls.clear()
            out[side] = _numpy(out[side])
        results[case] = out
    vverl._FusedStep.head = head
    vverl.remove()
    return results


SHARDED = ("vanilla-token-mean", "gspo-seq-mean-token-mean")


def _torch(tree):
    if isinstance(tree, dict):
        return {k: _torch(v) for k, v in tree.items()}
    return torch.from_numpy(tree) if hasattr(tree, "dtype") else tree


@pytest.fixture(scope="module")
def updates():
    """Every case on 2 data-parallel ranks (the module unwrapped: each rank's own gradients), and two on one rank
    with the module wrapped by FSDP2 (its hooks unshard and reduce the parameters around the fused loss)."""
    return {"dp2": run_ranks(_update, 2, list(CASES), False, timeout=480),
            "fsdp2": run_ranks(_update, 1, list(SHARDED), True, timeout=480)}


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("layout", ["dp2", "fsdp2"])
@pytest.mark.parametrize("case", list(CASES))
def test_actor_update_matches_verl(updates, case, layout):
    if layout == "fsdp2" and case not in SHARDED:
        pytest.skip("two cases under FSDP2")
    tol = CASES[case][-1]
    for rank, results in enumerate(updates[layout]):
        verl, ours = (_torch(results[case][side]) for side in ("verl", "vpce"))
        assert len(ours["loss"]) == 2, "two micro-batches per rank"
        assert (verl["fused"], ours["fused"]) == (0, 2), "vpce's side forms both micro-batches' loss in the forward"
        check(f"rank {rank} micro-batch losses", ours["loss"], verl["loss"], tol)
        assert set(ours["metrics"]) == set(verl["metrics"]), (sorted(ours["metrics"]), sorted(verl["metrics"]))
        for key, want in verl["metrics"].items():
            check(f"rank {rank} metric {key}", torch.tensor(ours["metrics"][key]), torch.tensor(want), tol)
        for name, want in verl["grads"].items():
            check(f"rank {rank} grad {name}", ours["grads"][name], want, tol)
        check(f"rank {rank} no-grad log_probs", ours["log_probs"], verl["log_probs"], tol)
        check(f"rank {rank} no-grad entropy", ours["entropy"], verl["entropy"], tol)
