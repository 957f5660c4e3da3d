"""``vpce.integrations.megatron.vocab_parallel_lm_loss`` against real megatron-core modules (gloo ranks, CPU).

Megatron's own path is the end of ``GPTModel._postprocess``: ``ColumnParallelLinear.forward`` (the hidden states
go through its copy region; its autograd Function all-reduces dX) gives this rank's ``[s, b, V/tp]`` logits, and
``LanguageModule.compute_language_model_loss(labels, logits)`` gives the per-token loss ``[b, s]`` through
``vocab_parallel_cross_entropy``. The drop-in gets the same layer, the same labels and no copy region, and must
give the same ``[b, s]`` loss, dX and dW shard. Both run in fp32 (megatron's softmax is fp32): bound 2e-6.

On CPU, megatron's sequence-parallel all-gather allocates its buffer on CUDA; with ``sequence_parallel=True`` the
reference logits come from torch's autograd all-gather + ``F.linear`` on the layer's own weight shard (as in
test_megatron.py), still followed by megatron's loss. Megatron includes padding rows in its softmax, so the padded
vocab case is checked against the float64 oracle over the gathered weight instead.

The ``gpt-*`` cases run a whole megatron-core ``GPTModel`` (local spec, 2 layers, megatron-core's own attention) on
the ranks, through ``launch/train_step.py``'s ``build_gpt`` and ``megatron_on_cpu`` (CPU stand-ins for its global
memory buffer, its CUDA RNG fork and, under SP, the current device; dropout is off): ``forward(input_ids,
position_ids, attention_mask, labels=labels)`` of the stock model against the same model after
``vpce.integrations.megatron.apply``: the loss and the gradient of every parameter, untied and tied, with
``reduction="sum"``/``"mean"`` and ``loss_mask``, a padded vocab (against the stock model built with the real vocab
and the same weights), ``main_grad``, and sequence parallelism (Megatron's own SP model and vpce's, each against the
model without SP and the same weights); ``labels=None`` still gives the stock logits, and ``remove`` gives the stock
model back.

One spawn of ranks per tp size runs every case (megatron-core takes seconds to import); each case is its own test.
The tp=2 ranks also run the docs' snippet (docs/integrations.md, Megatron-core) as written, in a process group of
its own, and the parent checks its result against the float64 oracle.
"""

import importlib.util
import os
import re
import socket
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_gather

from distributed import run_ranks
from vpce.reference import reference, rel_err
from problems import leaf

pytest.importorskip("megatron.core")

SEQ_PER_RANK, BATCH, D, ROWS = 5, 3, 24, 29  # ROWS: vocab rows per rank (odd, so shards are not aligned)
TOL = 2e-6  # fp32 against fp32 (megatron) or against float64 (oracle)
CASES = {
    2: ["replicated", "sequence-parallel", "padded-vocab", "padded-vocab-sp", "tied-embedding", "main-grad",
        "loss-mask", "gpt-untied", "gpt-tied", "gpt-padded-vocab", "gpt-main-grad", "gpt-sequence-parallel",
        "errors", "apply-errors", "doc-snippet"],
    4: ["replicated", "sequence-parallel", "padded-vocab-sp"],
}


def _config(world, sequence_parallel):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=D, num_attention_heads=world, tensor_model_parallel_size=world,
                             sequence_parallel=sequence_parallel, use_cpu_initialization=True,
                             perform_initialization=True, params_dtype=torch.float32,
                             gradient_accumulation_fusion=False)


def _output_layer(config, vocab_rows, *, seed, tied=False):
    """A GPTModel-style output layer; with tied=True the weight is a VocabParallelEmbedding's, as in GPTModel."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

    torch.manual_seed(seed)  # every rank builds the same master weight and keeps its shard
    init = partial(torch.nn.init.normal_, std=0.5)
    layer = ColumnParallelLinear(D, vocab_rows, config=config, init_method=init, bias=False, gather_output=False,
                                 skip_weight_param_allocation=tied)
    emb = VocabParallelEmbedding(vocab_rows, D, init_method=init, config=config) if tied else None
    return layer, emb


def _inputs(world, vocab, seed):
    """Full hidden [s, b, h], labels [b, s], upstream gradient [b, s]: identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    seq = SEQ_PER_RANK * world
    hidden = torch.randn(seq, BATCH, D, generator=gen)
    labels = torch.randint(0, vocab, (BATCH, seq), generator=gen)
    return hidden, labels, torch.randn(BATCH, seq, generator=gen)


def _slice(x, rank, sequence_parallel):
    return x[rank * SEQ_PER_RANK:(rank + 1) * SEQ_PER_RANK] if sequence_parallel else x


def _megatron_loss(lm, layer, hidden, labels, sequence_parallel, weight=None):
    """Megatron's path: output layer logits [s, b, V/tp], then compute_language_model_loss -> [b, s]."""
    if sequence_parallel:  # the layer's own SP all-gather needs CUDA: same logits through torch's all-gather
        full = torch.cat(all_gather(hidden, group=layer.tp_group), dim=0)
        logits = F.linear(full, layer.weight if weight is None else weight)
    else:
        logits, _ = layer(hidden, weight=weight)
    return lm.compute_language_model_loss(labels, logits)


def _case_same_as_megatron(rank, world, sp):
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from vpce.integrations.megatron import vocab_parallel_lm_loss

    config = _config(world, sp)
    lm = LanguageModule(config=config)
    layer, _ = _output_layer(config, ROWS * world, seed=1)
    hidden, labels, grad = _inputs(world, ROWS * world, seed=2)
    h = _slice(hidden, rank, sp)

    h_m = leaf(h)
    loss_m = _megatron_loss(lm, layer, h_m, labels, sp)
    loss_m.backward(grad)
    dw_m, layer.weight.grad = layer.weight.grad, None

    h_v = leaf(h)
    loss_v = vocab_parallel_lm_loss(h_v, layer, labels)
    loss_v.backward(grad)
    assert loss_v.shape == loss_m.shape == labels.shape, (loss_v.shape, loss_m.shape)
    return {"loss": rel_err(loss_v, loss_m), "dX": rel_err(h_v.grad, h_m.grad),
            "dW": rel_err(layer.weight.grad, dw_m)}


def _case_padded(rank, world, sp):
    """Real vocab not a multiple of tp * rows: vpce excludes the padding rows; float64 oracle over all shards."""
    from vpce.integrations.megatron import vocab_parallel_lm_loss

    vocab = ROWS * world - 7  # the last 7 rows of the last shard are padding
    config = _config(world, sp)
    layer, _ = _output_layer(config, ROWS * world, seed=3)
    hidden, labels, grad = _inputs(world, vocab, seed=4)
    h_v = leaf(_slice(hidden, rank, sp))
    loss_v = vocab_parallel_lm_loss(h_v, layer, labels, vocab_size=vocab)
    loss_v.backward(grad)

    full_w = torch.cat(all_gather(layer.weight.detach(), group=layer.tp_group))
    ref = reference(hidden.double(), full_w.double(), labels.t(), grad=grad.t(), reduction="none",
                    vocab_size=vocab)
    dw_ref = ref.dweight[rank * ROWS:(rank + 1) * ROWS]
    pad = layer.weight.grad[max(0, vocab - rank * ROWS):]
    return {"loss": rel_err(loss_v.t(), ref.loss), "dX": rel_err(h_v.grad, _slice(ref.dhidden, rank, sp)),
            "dW": rel_err(layer.weight.grad, dw_ref), "padding dW max": float(pad.abs().max()) if pad.numel() else 0.0}


def _case_tied(rank, world):
    """Tied embeddings: the loss uses VocabParallelEmbedding.weight, which also embedded the tokens."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from vpce.integrations.megatron import vocab_parallel_lm_loss

    config = _config(world, False)
    lm = LanguageModule(config=config)
    layer, emb = _output_layer(config, ROWS * world, seed=5, tied=True)
    _, labels, grad = _inputs(world, ROWS * world, seed=6)
    tokens = torch.roll(labels, 1, dims=1)

    def hidden_states():  # LanguageModelEmbedding: [b, s, h] -> [s, b, h]; tanh stands in for the decoder
        return torch.tanh(emb(tokens).transpose(0, 1).contiguous())

    loss_m = _megatron_loss(lm, layer, hidden_states(), labels, False, weight=emb.weight)
    loss_m.backward(grad)
    dw_m, emb.weight.grad = emb.weight.grad, None

    loss_v = vocab_parallel_lm_loss(hidden_states(), emb.weight, labels, config=config)  # raw weight
    loss_v.backward(grad)
    dw_v, emb.weight.grad = emb.weight.grad, None

    loss_l = vocab_parallel_lm_loss(hidden_states(), layer, labels, weight=emb.weight)  # GPTModel's spelling
    loss_l.backward(grad)
    return {"loss": rel_err(loss_v, loss_m), "dW (lookup + loss)": rel_err(dw_v, dw_m),
            "loss, weight= form": rel_err(loss_l, loss_m), "dW, weight= form": rel_err(emb.weight.grad, dw_m)}


def _case_main_grad(rank, world):
    """gradient_accumulation_fusion: two micro-batches add their fp32 dW into main_grad; .grad is a placeholder."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from vpce.integrations.megatron import vocab_parallel_lm_loss

    config = _config(world, False)
    lm = LanguageModule(config=config)
    layer, _ = _output_layer(config, ROWS * world, seed=7)
    w = layer.weight
    batches = [_inputs(world, ROWS * world, seed=s) for s in (8, 9)]

    for hidden, labels, grad in batches:  # megatron's unfused fp32 gradients, summed by autograd in .grad
        _megatron_loss(lm, layer, leaf(hidden), labels, False).backward(grad)
    dw_sum, w.grad = w.grad, None

    # Built unfused (fused_weight_gradient_mlp_cuda is CUDA-only); flip the switch the integration reads.
    layer.config.gradient_accumulation_fusion = True
    w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    w.grad_added_to_main_grad = False
    out = {}
    for i, (hidden, labels, grad) in enumerate(batches):
        w.zero_out_wgrad = i == 1
        vocab_parallel_lm_loss(leaf(hidden), layer, labels).backward(grad)
        out[f"placeholder {i} shape ok"] = w.grad is not None and w.grad.shape == w.shape
        out[f"flag set {i}"] = w.grad_added_to_main_grad is True
        if i == 1:
            out["zero_out_wgrad placeholder is zeros"] = bool((w.grad == 0).all())
        w.grad, w.grad_added_to_main_grad = None, False  # what megatron's DDP hook does after each backward
    return {"main_grad": rel_err(w.main_grad, dw_sum), **out}


def _case_loss_mask(rank, world):
    """reduction="sum"/"mean" with Megatron's loss_mask equal megatron's loss_func over the per-token losses."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from vpce.integrations.megatron import vocab_parallel_lm_loss

    config = _config(world, False)
    lm = LanguageModule(config=config)
    layer, _ = _output_layer(config, ROWS * world, seed=10)
    hidden, labels, _ = _inputs(world, ROWS * world, seed=11)
    loss_mask = (torch.arange(labels.numel()).reshape(labels.shape) % 4 != 0).float()
    out = {}
    for reduction in ("sum", "mean"):
        h_m = leaf(hidden)
        per_token = _megatron_loss(lm, layer, h_m, labels, False)
        loss_m = torch.sum(per_token.view(-1) * loss_mask.view(-1))  # pretrain_gpt.loss_func's numerator
        if reduction == "mean":
            loss_m = loss_m / loss_mask.sum()
        loss_m.backward()
        dw_m, layer.weight.grad = layer.weight.grad, None
        h_v = leaf(hidden)
        loss_v = vocab_parallel_lm_loss(h_v, layer, labels, loss_mask=loss_mask, reduction=reduction)
        loss_v.backward()
        out.update({f"{reduction} loss": rel_err(loss_v, loss_m), f"{reduction} dX": rel_err(h_v.grad, h_m.grad),
                    f"{reduction} dW": rel_err(layer.weight.grad, dw_m)})
        layer.weight.grad = None
    return out


def _errors_of(calls: dict) -> dict:
    """Each call's ``"TypeError: ..."`` / ``"ValueError: ..."``, or ``"no error"``."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _case_errors(rank, world):
    from vpce.integrations.megatron import vocab_parallel_lm_loss

    layer, _ = _output_layer(_config(world, False), ROWS * world, seed=12)
    hidden, labels, _ = _inputs(world, ROWS * world, seed=13)
    calls = {
        "labels 1-D": lambda: vocab_parallel_lm_loss(hidden, layer, labels[0]),
        "vocab_size > rows": lambda: vocab_parallel_lm_loss(hidden, layer, labels, vocab_size=ROWS * world + 1),
        "weight= wrong shape": lambda: vocab_parallel_lm_loss(hidden, layer, labels, weight=layer.weight[1:]),
        "loss_mask wrong shape": lambda: vocab_parallel_lm_loss(hidden, layer, labels, loss_mask=labels.t()),
        "not an output layer": lambda: vocab_parallel_lm_loss(hidden, torch.nn.Linear(D, ROWS), labels),
    }
    return _errors_of(calls)


# -- the whole GPTModel --------------------------------------------------------------------------------------------

GPT_SEQ, GPT_BATCH, GPT_VOCAB = 10, 3, 58  # GPT_VOCAB: the real vocab; 58 = 2 * 29 rows unpadded at tp=2


def _train_step():
    """launch/train_step.py (not a package): build_gpt, megatron_on_cpu, ModelShape."""
    name = "launch_train_step"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "launch" / "train_step.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def _gpt(world, *, tied, rows=GPT_VOCAB, seed=20, sequence_parallel=False):
    ts = _train_step()
    shape = ts.ModelShape(vocab=GPT_VOCAB, hidden=D, layers=2, heads=4, kv_heads=2, ffn=2 * D, tied=tied)
    return ts.build_gpt(shape, world, torch.device("cpu"), seq=GPT_SEQ, seed=seed, attention="local",
                        padded_vocab=rows, sequence_parallel=sequence_parallel)


def _gpt_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_SEQ + 1), generator=gen)
    position_ids = torch.arange(GPT_SEQ).expand(GPT_BATCH, GPT_SEQ)
    causal = torch.ones(GPT_SEQ, GPT_SEQ, dtype=torch.bool).triu(1)[None, None]  # True: masked
    loss_mask = (torch.rand(GPT_BATCH, GPT_SEQ, generator=gen) > 0.25).float()
    grad = torch.randn(GPT_BATCH, GPT_SEQ, generator=gen)
    return ids[:, :-1], position_ids, causal, ids[:, 1:], loss_mask, grad


def _grads(model):
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _compare_grads(got: dict, want: dict, label: str) -> dict:
    if set(got) != set(want):
        return {f"{label}: same parameters got gradients": False}
    worst = max(want, key=lambda n: rel_err(got[n], want[n]))
    return {f"{label} ({len(want)} params; worst {worst})": rel_err(got[worst], want[worst])}


def _case_gpt(rank, world, tied):
    """The model's own forward, stock vs after apply: per-token, sum and mean with loss_mask, labels=None, remove."""
    import vpce.integrations.megatron as vm

    model = _gpt(world, tied=tied)
    ids, pos, causal, labels, loss_mask, grad = _gpt_batch(21)
    out = {}
    per_token = model(ids, pos, causal, labels=labels)
    per_token.backward(grad)
    stock = _grads(model)
    logits = model(ids, pos, causal).detach()
    sums = {}
    for reduction in ("sum", "mean"):
        loss = (per_token.detach() * loss_mask).sum()
        sums[reduction] = loss / loss_mask.sum() if reduction == "mean" else loss
        (model(ids, pos, causal, labels=labels) * loss_mask / (loss_mask.sum() if reduction == "mean" else 1)
         ).sum().backward()
        sums[reduction + " grads"] = _grads(model)

    vm.apply([model])  # Megatron-LM's list of model chunks
    out["is_applied"] = vm.is_applied(model) and vm.is_applied([model])
    got = model(ids, pos, causal, labels=labels)
    got.backward(grad)
    out["per-token loss"] = rel_err(got, per_token)
    out["shape [b, s]"] = got.shape == per_token.shape
    out.update(_compare_grads(_grads(model), stock, "per-token grads"))
    for reduction in ("sum", "mean"):
        vm.apply(model, reduction=reduction)
        loss = model(ids, pos, causal, labels=labels, loss_mask=loss_mask)
        loss.backward()
        out[f"{reduction} loss"] = rel_err(loss, sums[reduction])
        out.update(_compare_grads(_grads(model), sums[reduction + " grads"], f"{reduction} grads"))
    out["labels=None: stock logits"] = torch.equal(model(ids, pos, causal).detach(), logits)
    vm.remove(model)
    out["removed"] = not vm.is_applied(model) and "_postprocess" not in model.__dict__
    out["after remove: stock loss"] = torch.equal(model(ids, pos, causal, labels=labels).detach(), per_token.detach())
    return out


def _full(shard, group):
    return torch.cat(all_gather(shard.detach().contiguous(), group=group))


def _case_gpt_padded(rank, world):
    """A model built with padded rows, apply(vocab_size=real), equals the stock model built with the real vocab and
    the same weights; the padding rows get zero gradient."""
    import vpce.integrations.megatron as vm
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    rows = 64  # 32 per rank: the last 6 rows of rank 1 are padding
    real = _gpt(world, tied=False)
    padded = _gpt(world, tied=False, rows=rows)
    vocab_weights = ("embedding.word_embeddings.weight", "output_layer.weight")
    state = {k: v for k, v in real.state_dict().items() if k not in vocab_weights}
    padded.load_state_dict(state, strict=False)
    gen = torch.Generator().manual_seed(22)
    for name in vocab_weights:
        full = torch.cat([_full(real.get_parameter(name), group), torch.randn(rows - GPT_VOCAB, D, generator=gen)])
        with torch.no_grad():
            padded.get_parameter(name).copy_(full[rank * rows // world:(rank + 1) * rows // world])
    ids, pos, causal, labels, _, grad = _gpt_batch(23)
    want = real(ids, pos, causal, labels=labels)
    want.backward(grad)
    stock = _grads(real)
    vm.apply(padded, vocab_size=GPT_VOCAB)
    got = padded(ids, pos, causal, labels=labels)
    got.backward(grad)
    grads = _grads(padded)
    out = {"loss": rel_err(got, want)}
    for name in vocab_weights:
        full = _full(grads.pop(name), group)
        out[f"{name} grad, real rows"] = rel_err(full[:GPT_VOCAB], _full(stock.pop(name), group))
        out[f"{name} padding rows: zero grad"] = bool((full[GPT_VOCAB:] == 0).all())
    out.update(_compare_grads(grads, stock, "other grads"))
    return out


def _case_gpt_main_grad(rank, world):
    """gradient_accumulation_fusion: two micro-batches through the model's forward add the output layer's fp32
    gradient into main_grad (megatron-core's DDP hook emulated between them); every other parameter's .grad is
    the stock one."""
    import vpce.integrations.megatron as vm

    model = _gpt(world, tied=False)
    batches = [_gpt_batch(s) for s in (24, 25)]
    for ids, pos, causal, labels, _, grad in batches:
        model(ids, pos, causal, labels=labels).backward(grad)
    stock = _grads(model)

    vm.apply(model)
    model.config.gradient_accumulation_fusion = True  # built unfused: the decoder's layers keep their own False
    w = model.output_layer.weight
    w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    out = {}
    for i, (ids, pos, causal, labels, _, grad) in enumerate(batches):
        w.grad_added_to_main_grad = False
        model(ids, pos, causal, labels=labels).backward(grad)
        out[f"micro-batch {i}: grad_added_to_main_grad"] = w.grad_added_to_main_grad is True
        w.grad = None  # megatron-core's DDP hook: .grad already in main_grad, dropped
    grads = _grads(model)
    out["output layer main_grad"] = rel_err(w.main_grad, stock.pop("output_layer.weight"))
    out.update(_compare_grads(grads, stock, "other grads"))
    return out


def _case_gpt_sp(rank, world):
    """Sequence parallelism (train_step's SequenceParallelNorm: torch's norm, its weight gradient all-reduced over
    the group as finalize_model_grads does): Megatron's own SP model and the same model after apply, each against
    the model without SP and the same weights."""
    import vpce.integrations.megatron as vm
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    ref, sp = _gpt(world, tied=False), _gpt(world, tied=False, sequence_parallel=True)
    out = {"same weights": all(torch.equal(a, b) for a, b in zip(ref.parameters(), sp.parameters()))}
    ids, pos, causal, labels, loss_mask, grad = _gpt_batch(26)
    want = ref(ids, pos, causal, labels=labels)
    want.backward(grad)
    stock = _grads(ref)

    def reduced(model):
        grads = _grads(model)
        for name, g in grads.items():
            if getattr(model.get_parameter(name), "sequence_parallel", False):
                dist.all_reduce(g, group=group)
        return grads

    for label in ("megatron SP", "vpce SP"):
        if label == "vpce SP":
            vm.apply(sp)
        got = sp(ids, pos, causal, labels=labels)
        got.backward(grad)
        out[f"{label}: loss"] = rel_err(got, want)
        out.update(_compare_grads(reduced(sp), stock, f"{label}: grads"))
    vm.apply(sp, reduction="sum")
    loss = sp(ids, pos, causal, labels=labels, loss_mask=loss_mask)
    loss.backward()
    out["vpce SP, sum with loss_mask: loss"] = rel_err(loss, (want.detach() * loss_mask).sum())
    ref(ids, pos, causal, labels=labels).backward(loss_mask)
    out.update(_compare_grads(reduced(sp), _grads(ref), "vpce SP, sum with loss_mask: grads"))
    return out


def _case_apply_errors(rank, world):
    import vpce.integrations.megatron as vm

    model = _gpt(world, tied=False)
    calls = {
        "not a model": lambda: vm.apply(torch.nn.Linear(2, 2)),
        "reduction": lambda: vm.apply(model, reduction="avg"),
        "vocab_size too large": lambda: vm.apply(model, vocab_size=GPT_VOCAB + 1),
        "vocab_size not int": lambda: vm.apply(model, vocab_size=57.0),
        "unknown option": lambda: vm.apply(model, group=None),
    }
    return _errors_of(calls), not vm.is_applied(model)


def _main(rank, world, cases):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    run = {
        "replicated": lambda: _case_same_as_megatron(rank, world, False),
        "sequence-parallel": lambda: _case_same_as_megatron(rank, world, True),
        "padded-vocab": lambda: _case_padded(rank, world, False),
        "padded-vocab-sp": lambda: _case_padded(rank, world, True),
        "tied-embedding": lambda: _case_tied(rank, world),
        "main-grad": lambda: _case_main_grad(rank, world),
        "loss-mask": lambda: _case_loss_mask(rank, world),
        "errors": lambda: _case_errors(rank, world),
        "gpt-untied": lambda: _case_gpt(rank, world, tied=False),
        "gpt-tied": lambda: _case_gpt(rank, world, tied=True),
        "gpt-padded-vocab": lambda: _case_gpt_padded(rank, world),
        "gpt-main-grad": lambda: _case_gpt_main_grad(rank, world),
        "gpt-sequence-parallel": lambda: _case_gpt_sp(rank, world),
        "apply-errors": lambda: _case_apply_errors(rank, world),
    }
    with _train_step().megatron_on_cpu():
        results = {case: run[case]() for case in cases if case != "doc-snippet"}
    dist.barrier()
    ps.destroy_model_parallel()
    if "doc-snippet" in cases:
        results["doc-snippet"] = _run_doc_snippet(rank)
    return results


def _doc_snippet() -> str:
    """The runnable python block (the one starting with its torchrun line) of docs/integrations.md's
    Megatron-core section."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    if "## Megatron-core" not in text:
        raise AssertionError("no '## Megatron-core' section in docs/integrations.md")
    section = text.split("## Megatron-core", 1)[1]
    return next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if b.startswith("# torchrun"))


def _run_doc_snippet(rank):
    """Run the docs snippet as written: it creates (and destroys) its own process group on a fresh port."""
    port = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    ns = {"__name__": "__snippet__"}
    exec(compile(_doc_snippet(), "docs snippet (Megatron-core)", "exec"), ns)
    w = ns["output_layer"].weight
    # numpy arrays travel back by value (torch tensors would go through shared memory of an exiting process)
    return {k: v.detach().numpy() if isinstance(v, torch.Tensor) else v for k, v in (
        ("per_token", ns["per_token"]), ("loss", ns["loss"]), ("hidden", ns["hidden"]),
        ("dX", ns["hidden"].grad), ("labels", ns["labels"]), ("loss_mask", ns["loss_mask"]), ("weight", w),
        ("dW", w.grad), ("vocab", ns["vocab"]))}


_RESULTS: dict[int, list | AssertionError] = {}


def _results(world, case):
    """Each rank's checks for ``case``; the ranks of one tp size are spawned once, a failure is reported once."""
    if world not in _RESULTS:
        try:
            _RESULTS[world] = run_ranks(_main, world, CASES[world], cpu_only=True)
        except AssertionError as e:
            _RESULTS[world] = e
            raise
    if isinstance(_RESULTS[world], AssertionError):
        pytest.fail(f"the tp={world} ranks failed earlier in this module (see the first failing test)")
    return [(rank, r[case]) for rank, r in enumerate(_RESULTS[world])]


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases
                                        if c not in ("errors", "apply-errors", "doc-snippet")])
def test_same_as_megatron(world, case):
    for rank, checks in _results(world, case):
        for name, value in checks.items():
            where = f"tp={world} rank {rank}, {case}: {name}"
            if isinstance(value, bool):
                assert value, f"{where} is False"
            elif name == "padding dW max":
                assert value == 0.0, f"{where}: padding rows got gradient {value:.2e}"
            else:
                assert value < TOL, f"{where} differs by {value:.2e} (bound {TOL:.0e})"


def test_bad_arguments_raise():
    for rank, messages in _results(2, "errors"):
        for name, msg in messages.items():
            assert msg != "no error", f"rank {rank}: {name} did not raise"
        assert messages["labels 1-D"].startswith("ValueError: labels: expected shape (3, 10)"), messages
        assert messages["vocab_size > rows"].startswith("ValueError: vocab_size"), messages
        assert messages["weight= wrong shape"].startswith("ValueError: weight"), messages
        assert messages["loss_mask wrong shape"].startswith("ValueError: loss_mask"), messages
        assert messages["not an output layer"].startswith("TypeError: output_layer"), messages


def test_apply_bad_arguments_raise():
    for rank, (messages, unpatched) in _results(2, "apply-errors"):
        assert unpatched, f"rank {rank}: a refused apply left the model patched"
        for name, msg in messages.items():
            assert msg != "no error", f"rank {rank}: {name} did not raise"
        assert messages["not a model"].startswith("TypeError: model: expected a megatron-core GPTModel"), messages
        assert messages["reduction"].startswith("ValueError: reduction"), messages
        assert messages["vocab_size too large"].startswith("ValueError: vocab_size"), messages
        assert messages["vocab_size not int"].startswith("TypeError: vocab_size"), messages
        assert messages["unknown option"].startswith("TypeError: apply: unexpected options ['group']"), messages


def test_docs_snippet_runs_and_is_exact():
    """The docs snippet (SP, padded vocab, loss_mask) on 2 ranks against the float64 oracle over all shards."""
    ranks = [{k: torch.from_numpy(v) if k != "vocab" else v for k, v in r.items()}
             for _, r in _results(2, "doc-snippet")]
    first = ranks[0]
    for rank, r in enumerate(ranks):
        assert torch.equal(r["per_token"], first["per_token"]), f"rank {rank}: per-token loss differs from rank 0"
        assert torch.equal(r["labels"], first["labels"]), f"rank {rank}: labels differ (the snippet must seed them)"
    hidden = torch.cat([r["hidden"] for r in ranks])
    weight = torch.cat([r["weight"] for r in ranks])
    labels, mask, vocab = first["labels"], first["loss_mask"], first["vocab"]
    ref = reference(hidden.double(), weight.double(), labels.t(), grad=(mask / mask.sum()).t(), reduction="none",
                    vocab_size=vocab)
    loss_ref = (ref.loss.t() * mask).sum() / mask.sum()
    assert weight.shape[0] > vocab, f"the snippet should pad the vocab, got {weight.shape[0]} rows for {vocab}"
    checks = {"per-token loss": rel_err(first["per_token"], ref.loss.t()), "loss": rel_err(first["loss"], loss_ref),
              "dX": rel_err(torch.cat([r["dX"] for r in ranks]), ref.dhidden),
              "dW": rel_err(torch.cat([r["dW"] for r in ranks]), ref.dweight)}
    for name, err in checks.items():
        assert err < TOL, f"docs snippet, {name}: differs from float64 by {err:.2e} (bound {TOL:.0e})"
