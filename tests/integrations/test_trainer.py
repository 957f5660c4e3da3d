"""An end-to-end ``transformers.Trainer`` run with ``vpce.integrations.transformers.apply``, against the unpatched
run (CPU, fp32, a tiny random Llama, an in-memory dataset, no downloads).

Both runs start from the same weights, see the same batches in the same order (same seed), and log every step.
Gradient accumulation is on, so Trainer passes ``num_items_in_batch`` to the forward. The logged losses and
gradient norms must agree step by step, and the trained parameters at the end within 5% of
the distance AdamW moves them (its per-entry normalization amplifies rounding noise). A third run with
a z-loss is the negative control: its logged losses must differ by more than the tolerance.
"""

import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it

from vpce.integrations.transformers import apply, is_applied  # noqa: E402

V, D, S = 509, 32, 24
STEPS, BATCH, ACCUM = 4, 2, 2
LR, LOSS_RTOL, ADAM_TOL = 1e-2, 1e-5, 0.05
ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiny_llama(seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


class Rows(torch.utils.data.Dataset):
    """Causal-LM rows of uneven length: input_ids, attention_mask, labels (-100 on padding and on a prompt)."""

    def __init__(self, n: int, seed: int = 1):
        gen = torch.Generator().manual_seed(seed)
        self.rows = []
        for i in range(n):
            ids = torch.randint(0, V, (S,), generator=gen)
            length = S - 3 * (i % 4)  # right padding on some rows, so the token count differs between batches
            mask = (torch.arange(S) < length).long()
            labels = ids.masked_fill(mask == 0, -100)
            labels[: 2 + i % 3] = -100  # a masked prompt
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def train(model, tmp_path, name: str):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, data_seed=0, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(STEPS * BATCH * ACCUM))
    # read from the forward's signature: Trainer then passes num_items_in_batch, as to the stock model
    assert trainer.model_accepts_loss_kwargs, name
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory):
    """The unpatched run: (initial parameters, trained model, log), shared by the tests below."""
    stock = tiny_llama()
    initial = {name: p.detach().clone() for name, p in stock.named_parameters()}
    return initial, stock, train(stock, tmp_path_factory.mktemp("trainer"), "stock")


def test_trainer_matches_unpatched_step_by_step(stock_run, tmp_path):
    initial, stock, stock_log = stock_run
    model = apply(tiny_llama())
    assert all(torch.equal(p, initial[name]) for name, p in model.named_parameters())  # same start
    vpce_log = train(model, tmp_path, "vpce")
    assert is_applied(model) and not is_applied(stock)

    assert len(stock_log) == len(vpce_log) == STEPS, (stock_log, vpce_log)
    for step, (got, want) in enumerate(zip(vpce_log, stock_log), 1):
        assert got["step"] == want["step"] == step
        for key in ("loss", "grad_norm"):
            assert rel(got[key], want[key]) <= LOSS_RTOL, f"step {step} {key}: vpce {got[key]} vs stock {want[key]}"

    # Adam divides each gradient entry by its own RMS, so an entry whose gradient is ~1e-7 of the largest moves by
    # up to lr on rounding noise alone: parameters are compared in units of the Adam step, as in
    # test_integration_transformers.py::test_adamw_steps_track_stock.
    tol = ADAM_TOL * LR * STEPS
    stock_params = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        q = stock_params[name].detach()
        moved, diff = (q - initial[name]).abs().max().item(), (p.detach() - q).abs().max().item()
        assert moved > 10 * tol, f"{name} moved only {moved:.2e}: the comparison below would be weak"
        assert diff <= tol, f"{name}: differs by {diff:.2e} after {STEPS} AdamW steps (> {tol:.1e})"


def test_negative_control_z_loss_shows(stock_run, tmp_path):
    stock_log = stock_run[2]
    z_log = train(apply(tiny_llama(), z_loss=1e-3), tmp_path, "zloss")
    worst = max(rel(got["loss"], want["loss"]) for got, want in zip(z_log, stock_log))
    assert worst > 100 * LOSS_RTOL, f"a z-loss run should log different losses; worst rel diff {worst:.1e}"


def _snippet(document: str, test: str) -> str:
    """The ```python block under ``<!-- tested-by: tests/integrations/test_trainer.py::TEST -->`` in ``document``."""
    text = (ROOT / document).read_text()
    start = text.index(f"tested-by: tests/integrations/test_trainer.py::{test} -->")
    return text[start:].split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_trainer_snippet_runs():
    """README.md's Trainer snippet runs as written."""
    code = _snippet("README.md", "test_readme_trainer_snippet_runs")
    exec(compile(code, "README.md:Trainer", "exec"), {"__name__": "__snippet__"})


def test_docs_trainer_snippet_runs():
    """docs/integrations.md's Trainer snippet runs as written (it compares the logged losses with stock)."""
    code = _snippet("docs/integrations.md", "test_docs_trainer_snippet_runs")
    exec(compile(code, "integrations.md:Trainer", "exec"), {"__name__": "__snippet__"})


# -- every family, two Trainer steps -------------------------------------------------------------------------------

import hf_models  # noqa: E402


def two_steps(model, tmp_path, name: str, **trainer_kwargs):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
        learning_rate=LR, lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no", seed=0,
        data_seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        **{k: trainer_kwargs.pop(k) for k in ("label_smoothing_factor",) if k in trainer_kwargs})
    return transformers.Trainer(model=model, args=args, train_dataset=Rows(2 * BATCH * 2), **trainer_kwargs)


def logged(trainer):
    trainer.train()
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("family", list(hf_models.FAMILIES))
def test_every_family_two_trainer_steps_match_stock(family, tmp_path):
    """Each family's patched model, trained by Trainer for 2 steps (gradient accumulation on), logs stock's losses
    and gradient norms (MoE families: router aux loss included, as stock adds it)."""
    model, stock = hf_models.pair(family)
    got = logged(two_steps(apply(model), tmp_path, "vpce"))
    want = logged(two_steps(stock, tmp_path, "stock"))
    assert len(got) == len(want) == 2, (got, want)
    for i, ((loss, norm), (stock_loss, stock_norm)) in enumerate(zip(got, want), 1):
        assert rel(loss, stock_loss) <= LOSS_RTOL, f"{family} step {i} loss: vpce {loss} vs stock {stock_loss}"
        assert rel(norm, stock_norm) <= 1e-4, f"{family} step {i} grad_norm: vpce {norm} vs stock {stock_norm}"


def test_label_smoothing_factor_becomes_vpces(tmp_path):
    """apply(trainer) maps Trainer's label_smoothing_factor onto vpce's label_smoothing: the logged losses are those
    of stock Trainer's LabelSmoother (the same definition), with no logits. Control: without smoothing the gradient
    norms differ (the loss of a near-uniform random model hardly moves)."""
    model, stock = hf_models.pair("llama")
    trainer = apply(two_steps(model, tmp_path, "vpce", label_smoothing_factor=0.1))
    assert trainer.label_smoother is None and is_applied(trainer)
    got = logged(trainer)
    want = logged(two_steps(stock, tmp_path, "stock", label_smoothing_factor=0.1))
    plain = logged(two_steps(hf_models.model("llama"), tmp_path, "plain"))
    for (loss, norm), (stock_loss, stock_norm), (_, plain_norm) in zip(got, want, plain):
        assert rel(loss, stock_loss) <= LOSS_RTOL and rel(norm, stock_norm) <= 1e-4, (got, want)
        assert rel(plain_norm, stock_norm) > 100 * 1e-4, f"smoothing changes the grad norm too little: {plain}"


def test_label_smoothing_factor_with_apply_model_is_refused_at_the_first_step(tmp_path):
    trainer = two_steps(apply(hf_models.model("llama")), tmp_path, "vpce", label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0.1.*apply\(trainer\)"):
        trainer.train()
