"""verl 0.9.1's Megatron actor update with ``vpce.integrations.verl.apply()`` against verl's own, on CPU.

Both sides run verl's Megatron engine code (``MegatronEngineWithLMHead.forward_backward_batch``: its micro-batches,
its ``forward_step`` with the fused-kernel forward ``model_forward_fused.fused_forward_model_engine`` that packs
each micro-batch with ``preprocess_thd_engine`` and gathers the sequence-parallel hidden states, its
``postprocess_micro_batch_func`` with verl's ``ppo_loss`` as the loss function, and megatron-core's own
``forward_step`` and ``backward_step`` per micro-batch) on a tiny megatron-core ``GPTModel`` in float64, over 2
gloo ranks (tensor parallel 2 with sequence parallelism, the output layer split by vocab) and on one rank. verl's
side gets its per-token log-probs and entropy from a float64 torch head in place of verl's Triton kernel
(``linear_cross_entropy``: every rank's logits over the gathered vocab, each rank's hidden-state gradient from its
own shard, as verl's kernel returns it) and computes verl's ``ppo_loss`` on them; vpce's side is the same engine
after ``apply()``: the policy loss is formed inside the head, fused. Compared on each rank: the micro-batches'
losses, verl's metrics, every parameter's gradient, and the no-grad log-probs and entropy of ``infer_batch`` at the
response positions.

Not run here: the engine's construction (``MegatronEngine.__init__`` / ``initialize`` build the model through
mbridge from a Hugging Face checkpoint, with megatron-core's DDP and optimizer on CUDA); the test sets the attributes
that the forward step reads, and verl's ``get_device_id`` points at the CPU. megatron-core's
``forward_backward_no_pipelining`` allocates a token counter on CUDA: ``no_pipelining_on_cpu`` is its loop over the
micro-batches, through megatron-core's ``forward_step`` and ``backward_step``. The model is built from
megatron-core's local layer spec with two CPU stand-ins: the core attention is causal attention over each packed
sequence (``PackedCausalAttention``; megatron-core's local ``DotProductAttention`` refuses packed sequences and TE's
is CUDA-only), and the norms are torch's under sequence parallelism (``launch/train_step.py``'s
``SequenceParallelNorm``); no position embedding (verl's packed forward passes no position ids and megatron-core's
RoPE needs CUDA). ``megatron_on_cpu`` supplies the CPU memory buffer and RNG fork.
"""

import functools
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
pytest.importorskip("verl.workers.engine.megatron.transformer_impl", reason="verl 0.9.x with megatron-core")

from distributed import run_ranks  # noqa: E402
from test_integration_megatron import _train_step  # noqa: E402
from test_post_training import CUDA  # noqa: E402
from vpce.reference import rel_err  # noqa: E402

V, D, P, R = 98, 32, 5, 6  # vocab (49 rows per rank), width, prompt and response width (left / right padded)
TOL = 1e-10  # float64 on both sides
CASES = {  # id: (loss mode, aggregation)
    "vanilla-token-mean": ("vanilla", "token-mean"),
    "vanilla-seq-mean-token-sum": ("vanilla", "seq-mean-token-sum"),
    "gspo-seq-mean-token-mean": ("gspo", "seq-mean-token-mean"),
    "clip_cov-token-mean": ("clip_cov", "token-mean"),
}


class PackedCausalAttention(torch.nn.Module):
    """megatron-core's core-attention interface for packed (thd) micro-batches: query ``[t, heads, hn]``, key and
    value ``[t, groups, hn]`` with ``packed_seq_params``; causal attention within each packed sequence (rows
    ``cu_seqlens_q_padded[i]`` to ``[i + 1]``), ``[t, heads * hn]`` out."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params: expected verl's thd packing, got {packed_seq_params}")
        cu = packed_seq_params.cu_seqlens_q_padded.tolist()
        heads = query.shape[1]
        out = []
        for start, end in zip(cu[:-1], cu[1:]):
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [heads, s, hn]
            if k.shape[0] != heads:
                k, v = (x.repeat_interleave(heads // x.shape[0], dim=0) for x in (k, v))
            out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale))
        return torch.cat(out, dim=1).transpose(0, 1).reshape(query.shape[0], -1)


def _model(world):
    """A 2-layer GPTModel in float64, tensor parallel over the world with sequence parallelism."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    norm = _train_step().SequenceParallelNorm
    config = TransformerConfig(
        num_layers=2, hidden_size=D, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=2 * D,
        tensor_model_parallel_size=world, sequence_parallel=world > 1, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float64, pipeline_dtype=torch.float64,
        use_cpu_initialization=True, perform_initialization=True, gradient_accumulation_fusion=False,
        init_method_std=0.3)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedCausalAttention
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
    spec = TransformerBlockSubmodules(layer_specs=[spec] * 2, layer_norm=norm)
    torch.manual_seed(0)  # every rank draws the same master weights and keeps its shards
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=64,
                     position_embedding_type="none", parallel_output=True)
    return model.to(torch.float64)


def torch_head(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """verl's ``linear_cross_entropy`` contract in float64 torch: per-token log-probs and entropy over the whole
    vocab (the shards gathered, in rank order); backward gives this rank's vocab shard its weight gradient and the
    hidden states the part of their gradient that flows through this rank's shard (verl's gather of the
    sequence-parallel hidden states sums the parts)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(dist_process_group), dist.get_world_size(dist_process_group)
    shards = [torch.empty_like(weight) for _ in range(world)]
    dist.all_gather(shards, weight.detach().contiguous(), group=dist_process_group)
    h = hidden.reshape(-1, hidden.shape[-1])
    logits = torch.cat([(h if r == rank else h.detach()) @ (weight if r == rank else w).T
                        for r, w in enumerate(shards)], dim=-1) / temperature
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, labels.reshape(-1, 1).to(torch.int64)).squeeze(-1), entropy


def no_pipelining_on_cpu(*, forward_step_func, data_iterator, model, num_microbatches, forward_only=False, **_):
    """megatron-core's ``forward_backward_no_pipelining`` (what ``get_forward_backward_func`` returns without
    pipeline parallelism) for the CPU: its loop over the micro-batches, each through megatron-core's own
    ``forward_step`` (the loss function's scaling included) and ``backward_step``, without the token counter it
    allocates on CUDA (read only with ``calculate_per_token_loss``)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_config, get_model_type

    (model,), (data_iterator,) = model, [data_iterator] if not isinstance(data_iterator, list) else data_iterator
    config = get_model_config(model)
    store = []
    for i in range(num_microbatches):
        output, _ = schedules.forward_step(forward_step_func, data_iterator, model, num_microbatches, None, store,
                                           config, 1, is_first_microbatch=i == 0, current_microbatch=i)
        if not forward_only:
            schedules.backward_step(None, output, None, get_model_type(model), config)
    return store


def _engine(model, world):
    """verl's Megatron engine with an LM head, holding ``model``: the attributes its forward step reads."""
    from transformers import LlamaConfig
    from verl.workers.config import McoreEngineConfig
    from verl.workers.config.model import MtpConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(strategy="megatron", tensor_model_parallel_size=world,
                                             sequence_parallel=True, use_fused_kernels=True, use_remove_padding=True)
    engine.model_config = types.SimpleNamespace(hf_config=LlamaConfig(architectures=["LlamaForCausalLM"]),
                                                tokenizer=types.SimpleNamespace(pad_token_id=0), mtp=MtpConfig(),
                                                model_type="language_model")
    engine.tf_config, engine.module = model.config, [model]
    engine.is_value_model, engine.enable_routing_replay, engine.mini_layer_topk_idx_list = False, False, []
    engine._maybe_enable_fused_kernels()  # verl's patch_fused_forward on the model
    return engine


def _batch(train=True):
    """verl's update batch (the same on every tensor-parallel rank): left-padded prompts, right-padded responses
    (sequences of odd length, which the packing pads to a multiple of the tensor-parallel size), one masked token
    inside a response, converted by verl's ``left_right_2_no_padding``; the keys its trainer and worker add."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(10)
    b = 4
    plen, rlen = torch.tensor([5, 3, 4, 2]), torch.tensor([6, 4, 1, 5])
    ids = torch.randint(0, V, (b, P + R), generator=g)
    attn = torch.zeros(b, P + R, dtype=torch.long)
    for i in range(b):
        attn[i, P - plen[i]:P + rlen[i]] = 1
    response_mask = attn[:, P:].double()
    response_mask[0, 1] = 0
    f64 = dict(generator=g, dtype=torch.float64)
    td = TensorDict({"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
                     "prompts": ids[:, :P], "responses": ids[:, P:], "response_mask": response_mask,
                     "old_log_probs": -torch.rand(b, R, **f64) * 2 - 3.8, "advantages": torch.randn(b, R, **f64),
                     "ref_log_prob": -torch.rand(b, R, **f64) * 2 - 3.8}, batch_size=[b])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=0.7, calculate_entropy=True, global_batch_size=b, use_remove_padding=True,
                         use_fused_kernels=True, micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                         compute_loss=train)
    return td


def _actor_config(loss_mode, agg):
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    return ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg,
                       entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl",
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode))


def _numpy(tree):  # tensors cross the process boundary as arrays (a shared tensor dies with its rank)
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    return tree.detach().numpy() if isinstance(tree, torch.Tensor) else tree


def _metrics(metrics):
    from verl.utils.metric import Metric

    return {k: [float(x) for x in (v.values if isinstance(v, Metric) else v)] for k, v in metrics.items()}


def _run(engine, model, loss_fn):
    """One actor update (two micro-batches) and one no-grad pass, as verl's trainer takes its log-probs."""
    import warnings

    from verl.workers.utils.padding import no_padding_2_padding

    torch.manual_seed(1)  # clip_cov draws a random subset of tokens: the same draw on both sides
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="vpce.integrations.verl")  # no fallback
        train = engine.forward_backward_batch(_batch(), loss_fn)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        data = _batch(train=False)
        infer = engine.infer_batch(data)
    out = infer["model_output"]
    return dict(loss=torch.tensor(train["loss"], dtype=torch.float64), metrics=_metrics(train["metrics"]),
                grads=grads, log_probs=no_padding_2_padding(out["log_probs"], data),
                entropy=no_padding_2_padding(out["entropy"], data))


def _update(rank, world, cases):
    from megatron.core import parallel_state as ps

    import verl.models.mcore.model_forward_fused as fused
    import verl.workers.engine.megatron.transformer_impl as megatron_impl
    from verl.workers.utils.losses import ppo_loss

    import vpce.integrations.verl as vverl

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    megatron_impl.get_device_id = lambda: "cpu"  # verl looks for an accelerator
    megatron_impl.get_forward_backward_func = lambda: no_pipelining_on_cpu
    verls_head = fused.linear_cross_entropy
    fused_calls = []  # the micro-batches whose loss vpce's head formed (the fused route, not a fallback)
    head = vverl._MegatronStep.head
    vverl._MegatronStep.head = lambda step, *a: fused_calls.append(1) or head(step, *a)
    results = {}
    try:
        with _train_step().megatron_on_cpu():
            for case in cases:
                loss_fn = functools.partial(ppo_loss, config=_actor_config(*CASES[case]))
                out = {}
                for side in ("verl", "vpce"):
                    model = _model(world)
                    engine = _engine(model, world)
                    if side == "verl":
                        fused.linear_cross_entropy = torch_head
                    else:
                        vverl.apply(backend="torch")
                    try:
                        out[side] = _run(engine, model, loss_fn)
                    finally:
                        vverl.remove()
                        fused.linear_cross_entropy = verls_head
                    out[side]["fused"] = len(fused_calls)
                    fused_calls.clear()
                results[case] = _numpy(out)
            # another loss function than verl's ppo_loss partial: verl's step on the log-probs of vpce's head
            config = _actor_config(*CASES["vanilla-token-mean"])
            model = _model(world)
            engine = _engine(model, world)
            vverl.apply(backend="torch")
            try:
                other = _run(engine, model, lambda **kw: ppo_loss(config=config, **kw))
            finally:
                vverl.remove()
            other["fused"] = len(fused_calls)
            results["other-loss"] = _numpy(other)
            results["removed"] = (fused.linear_cross_entropy is verls_head
                                  and not hasattr(megatron_impl.MegatronEngineWithLMHead.forward_step,
                                                  "_vpce_original")
                                  and not hasattr(fused.preprocess_thd_engine, "_vpce_original"))
    finally:
        vverl._MegatronStep.head = head
        ps.destroy_model_parallel()
    return results


def _torch(tree):
    if isinstance(tree, dict):
        return {k: _torch(v) for k, v in tree.items()}
    return torch.from_numpy(tree) if hasattr(tree, "dtype") else tree


TP1 = ("vanilla-token-mean", "gspo-seq-mean-token-mean")


@pytest.fixture(scope="module")
def updates():
    """Every case on 2 tensor-parallel ranks with sequence parallelism, and two on one rank (no tensor parallelism:
    the whole vocab, no gather); one spawn each (megatron-core and verl take seconds to import)."""
    return {"tp2": run_ranks(_update, 2, list(CASES), timeout=240),
            "tp1": run_ranks(_update, 1, list(TP1), timeout=240)}


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("layout", ["tp2", "tp1"])
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_actor_update_matches_verl(updates, case, layout):
    if layout == "tp1" and case not in TP1:
        pytest.skip("two cases without tensor parallelism")
    errors = {}  # what: relative error against verl's side
    for rank, results in enumerate(updates[layout]):
        verl, ours = (_torch(results[case][side]) for side in ("verl", "vpce"))
        assert len(ours["loss"]) == 2, "two micro-batches"
        assert (verl["fused"], ours["fused"]) == (0, 2), "vpce's side forms both micro-batches' loss in the head"
        assert set(ours["metrics"]) == set(verl["metrics"]), (sorted(ours["metrics"]), sorted(verl["metrics"]))
        assert set(ours["grads"]) == set(verl["grads"]), (sorted(ours["grads"]), sorted(verl["grads"]))
        assert all(bool(g.abs().sum() > 0) for g in verl["grads"].values()), "every parameter gets a gradient"
        errors[f"rank {rank} micro-batch losses"] = rel_err(ours["loss"], verl["loss"])
        for key, want in verl["metrics"].items():
            errors[f"rank {rank} metric {key}"] = rel_err(torch.tensor(ours["metrics"][key]), torch.tensor(want))
        for name, want in verl["grads"].items():
            errors[f"rank {rank} grad {name}"] = rel_err(ours["grads"][name], want)
        errors[f"rank {rank} no-grad log_probs"] = rel_err(ours["log_probs"], verl["log_probs"])
        errors[f"rank {rank} no-grad entropy"] = rel_err(ours["entropy"], verl["entropy"])
    worst = max(errors, key=errors.get)
    print(f"{layout} {case}: {len(errors)} comparisons, largest relative error {errors[worst]:.1e} ({worst})")
    bad = {k: f"{v:.1e}" for k, v in errors.items() if not v <= TOL}
    assert not bad, f"relative error above {TOL:.0e}: {bad}"


def _ranks(updates):
    return [(f"{layout} rank {rank}", r) for layout, ranks in updates.items() for rank, r in enumerate(ranks)]


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
def test_other_loss_functions_run_verls_step(updates):
    """A loss function other than ``partial(ppo_loss, config=...)``: verl's own step, its loss on the log-probs of
    vpce's head (the lean route), as exact."""
    for where, results in _ranks(updates):
        verl, ours = _torch(results["vanilla-token-mean"]["verl"]), _torch(results["other-loss"])
        assert ours["fused"] == 0, f"{where}: vpce's head formed the loss of another loss function"
        errors = {"micro-batch losses": rel_err(ours["loss"], verl["loss"])}
        errors.update({f"grad {n}": rel_err(ours["grads"][n], want) for n, want in verl["grads"].items()})
        worst = max(errors, key=errors.get)
        print(f"{where}, another loss function: largest relative error {errors[worst]:.1e} ({worst})")
        bad = {k: f"{v:.1e}" for k, v in errors.items() if not v <= TOL}
        assert not bad, f"{where}: relative error above {TOL:.0e}: {bad}"


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
def test_remove_restores_verls_megatron_code(updates):
    for where, results in _ranks(updates):
        assert results["removed"], f"{where}: remove() left vpce's Megatron patches in place"
