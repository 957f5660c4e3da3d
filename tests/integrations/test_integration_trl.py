"""``vpce.integrations.trl`` against TRL 1.16's own fused LM head, inside the real trainers (CPU, fp32).

Each case trains a tiny random Llama for a few steps twice from the same weights and data order: once with TRL's
head, once with vpce's (applied before the trainer is built, or after). The logged loss, gradient norm, ``entropy``
and ``mean_token_accuracy`` (DPO: also the summed log-probs) must agree step by step. The data repeat one pattern so
that the model's top-1 prediction becomes right on some tokens within the steps, and the accuracy is not 0
throughout. A unit test compares the five per-token fields of one head call, and with a logit scale, soft cap and
temperature.
"""

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import vpce  # noqa: E402
import vpce.integrations.trl as vtrl  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402

V, STEPS, RTOL = 96, 3, 2e-5
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(V - 3)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def tiny_llama(seed=0):
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def phrase(start, n):
    return " ".join(f"w{(start + 2 * i) % (V - 3)}" for i in range(n))


SFT_DATA = {"prompt": [phrase(i, 3) for i in range(8)], "completion": [phrase(10, 5 + i % 4) for i in range(8)]}
DPO_DATA = {"prompt": [phrase(i, 3) for i in range(8)], "chosen": [phrase(10, 4 + i % 3) for i in range(8)],
            "rejected": [phrase(41 + i, 3 + i % 3) for i in range(8)]}
KEYS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "logps/chosen", "logps/rejected")


def train(kind, head, tmp_path, when="before", **config):
    """Train ``STEPS`` steps; ``head``: "trl" or "vpce", applied ``when`` ("before"/"after") the trainer is built."""
    vtrl.remove()
    if head == "vpce" and when == "before":
        vtrl.apply(losses=False)  # the head only (tests/integrations/test_integration_trl_losses.py: the fused losses)
    common = dict(output_dir=str(tmp_path / f"{kind}-{head}"), max_steps=STEPS, per_device_train_batch_size=4,
                  learning_rate=3e-2, lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
                  seed=0, data_seed=0, use_cpu=True, disable_tqdm=True, bf16=False)
    if kind == "sft":
        trainer = trl.SFTTrainer(model=tiny_llama(), args=trl.SFTConfig(**common, **config),
                                 train_dataset=datasets.Dataset.from_dict(SFT_DATA), processing_class=tokenizer())
    else:
        trainer = trl.DPOTrainer(model=tiny_llama(), ref_model=tiny_llama(), args=trl.DPOConfig(**common, **config),
                                 train_dataset=datasets.Dataset.from_dict(DPO_DATA), processing_class=tokenizer())
    if head == "vpce" and when == "after":
        vtrl.apply(losses=False)
    try:
        trainer.train()
    finally:
        vtrl.remove()
    return [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]


@pytest.mark.parametrize("kind,config,when", [("sft", dict(loss_type="nll"), "before"),
                                              ("sft", dict(loss_type="dft"), "after"),
                                              ("dpo", {}, "after")], ids=["sft-nll", "sft-dft", "dpo"])
def test_trainer_matches_trl_head_step_by_step(kind, config, when, tmp_path, monkeypatch):
    calls = []
    real = vpce.linear_log_probs
    monkeypatch.setattr(vpce, "linear_log_probs", lambda *a, **k: calls.append(1) or real(*a, **k))
    want = train(kind, "trl", tmp_path, **config)
    assert not calls
    got = train(kind, "vpce", tmp_path, when=when, **config)
    assert len(calls) >= STEPS, "vpce's head was not used"
    assert len(got) == len(want) == STEPS
    assert max(e["mean_token_accuracy"] for e in want) > 0, "the accuracy comparison would be empty"
    for step, (g, w) in enumerate(zip(got, want), 1):
        for key in KEYS:
            if key in w:
                err = abs(g[key] - w[key]) / max(abs(w[key]), 1e-3)
                assert err <= RTOL, f"step {step} {key}: vpce {g[key]} vs TRL {w[key]}"


@pytest.mark.parametrize("scale,softcap,temperature", [(1.0, None, 1.0), (0.5, 3.0, 0.7)],
                         ids=["plain", "scale-cap-temperature"])
def test_head_fields_match_trl(scale, softcap, temperature):
    gen = torch.Generator().manual_seed(0)
    # fp32: TRL keeps its running statistics in fp32 whatever the inputs
    h = torch.randn(70, 24, generator=gen)
    w = torch.randn(V, 24, generator=gen) * 0.5
    b = torch.randn(V, generator=gen)
    t = torch.randint(0, V, (70,), generator=gen)
    z = (h @ w.t() + b) * scale
    t[::3] = z[::3].argmax(-1)  # some top-1 tokens
    args = (t, temperature, 32768, softcap, scale, OUTPUTS)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    want = ChunkedLogProbFunction.apply(*leaves, *args)
    ref_grads = torch.autograd.grad(want[0].sum() + want[1].sum(), leaves)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    got = vtrl.VpceLogProbHead(backend="torch").apply(*leaves, *args)
    grads = torch.autograd.grad(got[0].sum() + got[1].sum(), leaves)
    for name, g, r in zip(OUTPUTS, got, want):
        if name == "is_top1":
            assert g.dtype == torch.bool and torch.equal(g, r) and r.any()
        else:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=name)  # TRL's statistics are fp32
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    only = vtrl.VpceLogProbHead().apply(h, w, b, *args[:-1], ("log_probs", "is_top1"))
    assert only[1] is None and only[2] is None and only[3] is None and only[4].dtype == torch.bool


def test_apply_options_and_remove():
    with pytest.raises(TypeError, match="options: expected keywords among"):
        vtrl.apply(z_loss=1e-3)
    with pytest.raises(ValueError, match="memory_budget: expected 'auto' or 'lean'"):
        vtrl.apply(memory_budget="fast")
    head = vtrl.apply(memory_budget="lean")
    assert vtrl.is_applied() and trl.trainer.utils._ChunkedLogProbFunction is head
    vtrl.remove()
    assert not vtrl.is_applied() and trl.trainer.utils._ChunkedLogProbFunction is ChunkedLogProbFunction


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU")
def test_vocab_parallel_head():
    """``group=``: each rank computes its ``torch.chunk`` share of the rows; the fields and dX equal the unsharded
    head on every rank, and each rank's weight gradient is its own rows' (zero elsewhere: a Shard(0) DTensor's
    gather keeps only those)."""
    from distributed import run_ranks
    from trl_ranks import tp_head

    world = 3
    per_rank = run_ranks(tp_head, world, V, OUTPUTS, timeout=120)
    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(40, 16, generator=gen), torch.randn(V - 5, 16, generator=gen)
    t = torch.randint(0, V - 5, (40,), generator=gen)
    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    want = vtrl.VpceLogProbHead().apply(*leaves, None, t, 0.9, 32768, None, 1.0, OUTPUTS)
    (want[0].sum() + want[1].sum()).backward()
    rows = -(-(V - 5) // world)
    for rank, got in enumerate(per_rank):
        for name, g, r in zip(OUTPUTS + ("dX",), got, [*want, leaves[0].grad]):
            torch.testing.assert_close(torch.from_numpy(g), r.detach(), rtol=2e-5, atol=2e-5, msg=name)
        mine = slice(rank * rows, (rank + 1) * rows)
        dw = torch.from_numpy(got[-1])
        torch.testing.assert_close(dw[mine], leaves[1].grad[mine], rtol=2e-5, atol=2e-5)
        assert torch.count_nonzero(dw[: mine.start]) == 0 and torch.count_nonzero(dw[mine.stop:]) == 0


def test_docs_snippet_runs():
    """docs/integrations.md's TRL snippet runs as written, and trains every completion token: each row is the 3
    prompt words, the 4 completion words and EOS (8 tokens, 32 a step), and its labels are exactly the completion's
    (a completion without its leading space once merged into the prompt's last word, and TRL dropped a token)."""
    import pathlib
    import warnings

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    start = text.index("tested-by: tests/integrations/test_integration_trl.py::test_docs_snippet_runs -->")
    code = text[start:].split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {"__name__": "__snippet__"}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(code, "integrations.md:TRL", "exec"), namespace)
    finally:
        vtrl.remove()
    trainer, tokenizer = namespace["trainer"], namespace["tokenizer"]
    completion = tokenizer("w4 w5 w6 w7")["input_ids"] + [tokenizer.eos_token_id]
    for row in trainer.train_dataset:
        assert len(row["input_ids"]) == 8, row
        assert [t for t in row["labels"] if t != -100] == completion, row
    steps = [e for e in trainer.state.log_history if "num_tokens" in e]
    assert [e["num_tokens"] for e in steps] == [32.0 * (i + 1) for i in range(len(steps))], steps
    assert not [w for w in caught if "left out" in str(w.message) or "mismatch" in str(w.message)], caught
