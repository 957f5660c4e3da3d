"""``vpce.integrations.transformers``: patched ``*ForCausalLM`` models against stock transformers (CPU, fp32).

Every case builds a tiny random model of one family, keeps an unpatched deep copy (same weights), patches the
other with ``apply``, and compares the loss and every parameter gradient. Tolerances are fp32-level and relative
to the largest stock value; negative controls (no soft cap, no ``num_items_in_batch``) show that they can fail.
"""

import copy
import inspect
import pathlib
import re
import warnings

import pytest
import torch

from compare import assert_close, assert_grads_close, rel_err

transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402
from hf_models import AUX_COEF, FAMILIES, MOE_FAMILIES, SCALED, SOFTCAP, SOFTCAPPED, V  # noqa: E402
from vpce.integrations import transformers as vt  # noqa: E402
from vpce.memory import PeakMemory  # noqa: E402

B, S = 3, 17
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def build(family: str, *, tie: bool = False, vocab: int = V, seed: int = 0, **vpce_options):
    """(patched, stock): one tiny fp32 model of ``family`` and an unpatched deep copy of it."""
    model, stock = hf_models.pair(family, tie=tie, vocab=vocab, seed=seed)
    return vt.apply(model, **vpce_options), stock


def make_batch(vocab: int = V, batch: int = B, seq: int = S, seed: int = 1):
    """input_ids, attention_mask, labels: row 1 right-padded (mask 0, label -100), row 2 with a masked prompt."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[-1, :3] = -100
    return ids, mask, labels


def step(model, ids, mask, labels, **kwargs):
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    out.loss.backward()
    return out


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_grads_match_stock(family, tie):
    patched, stock = build(family, tie=tie)
    assert vt.is_applied(patched) and not vt.is_applied(stock)
    tied = patched.lm_head.weight is patched.get_input_embeddings().weight
    assert tied == tie, f"tie_word_embeddings={tie} but lm_head.weight is embed_tokens.weight: {tied}"
    ids, mask, labels = make_batch()
    got, want = step(patched, ids, mask, labels), step(stock, ids, mask, labels)
    assert got.logits is None and want.logits is not None
    assert got.loss.dtype == torch.float32
    assert_close(got.loss, want.loss, LOSS_RTOL, f"{family} loss")
    assert_grads_close(patched, stock, GRAD_RTOL)


@pytest.mark.parametrize("family", SOFTCAPPED)
def test_softcap_is_the_models(family):
    """The cap comes from config.final_logit_softcapping; leaving it out fails the same tolerance (control)."""
    _, stock = build(family)
    ids, mask, labels = make_batch()
    want = stock(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    hidden, weight = want.hidden_states[-1].detach(), stock.lm_head.weight.detach()
    capped = vt.causal_lm_loss(hidden, weight, labels, softcap=SOFTCAP)
    uncapped = vt.causal_lm_loss(hidden, weight, labels)
    assert_close(capped, want.loss, LOSS_RTOL, "capped loss")
    err, _ = rel_err(uncapped, want.loss)
    assert err > 100 * LOSS_RTOL, f"the loss without the soft cap is within {err:.1e} of stock's: weak test"


@pytest.mark.parametrize("family", SCALED)
def test_logit_scale_is_the_models(family):
    """Cohere's ``model.logit_scale`` and Granite's ``1 / config.logits_scaling`` reach vpce as ``logit_scale``,
    read at every call (stock reads them there too); leaving the scale out fails the same tolerance (control)."""
    patched, stock = build(family)
    ids, mask, labels = make_batch()
    if family.startswith("granite"):
        patched.config.logits_scaling = stock.config.logits_scaling = 0.25  # after apply: followed
    else:
        patched.logit_scale = stock.logit_scale = 3.0
    got = step(patched, ids, mask, labels)
    want = step(stock, ids, mask, labels, output_hidden_states=True)
    assert_close(got.loss, want.loss, LOSS_RTOL, "scaled loss")
    assert_grads_close(patched, stock, GRAD_RTOL)
    hidden, weight = want.hidden_states[-1].detach(), stock.lm_head.weight.detach()
    err, _ = rel_err(vt.causal_lm_loss(hidden, weight, labels), want.loss)
    assert err > 100 * LOSS_RTOL, f"the loss without the logit scale is within {err:.1e} of stock's: weak test"


@pytest.mark.parametrize("family,attr,value", [("cohere", "logit_scale", None), ("cohere", "logit_scale", -1.0),
                                               ("granite", "logits_scaling", 0.0)])
def test_apply_refuses_a_scale_it_cannot_reproduce(family, attr, value):
    """A scale vpce cannot take as ``logit_scale`` (None, <= 0: stock's logits would be garbage or flipped)
    is refused at apply, naming the model's attribute; set after apply, at the call."""
    patched, stock = build(family)
    holder = stock.config if family == "granite" else stock
    setattr(holder, attr, value)
    where = f"model.config.{attr}" if family == "granite" else f"model.{attr}"
    with pytest.raises(ValueError, match=rf"{where}: expected a finite number > 0"):
        vt.apply(stock)
    setattr(patched.config if family == "granite" else patched, attr, value)
    ids, mask, labels = make_batch()
    with pytest.raises(ValueError, match=rf"{where}: expected a finite number > 0"):
        patched(input_ids=ids, attention_mask=mask, labels=labels)


def test_num_items_in_batch():
    """transformers passes num_items_in_batch under gradient accumulation: sum / num_items, in both."""
    patched, stock = build("qwen3")
    ids, mask, labels = make_batch()
    num_items = torch.tensor(2 * int((labels[:, 1:] != -100).sum()))  # as if a second micro-batch followed
    got = step(patched, ids, mask, labels, num_items_in_batch=num_items)
    want = step(stock, ids, mask, labels, num_items_in_batch=num_items)
    assert_close(got.loss, want.loss, LOSS_RTOL, "loss with num_items_in_batch")
    assert_grads_close(patched, stock, GRAD_RTOL)
    err, _ = rel_err(patched(input_ids=ids, attention_mask=mask, labels=labels).loss, want.loss)
    assert err > 0.1, f"the mean loss is within {err:.1e} of the num_items_in_batch loss: weak test"


@pytest.mark.parametrize("variant", ["ignore_index", "shift_labels+logits_to_keep"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_loss_keywords(family, variant):
    """Keywords ForCausalLMLoss reads from the forward's **kwargs, and logits_to_keep before the loss."""
    patched, stock = build(family)
    ids, mask, labels = make_batch()
    if variant == "ignore_index":
        kwargs = {"ignore_index": 7, "labels": labels.masked_fill(labels == -100, 7)}
    else:
        keep = 9
        # stock .view()s shift_labels, so it must be contiguous
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, -keep:].contiguous()
        kwargs = {"labels": labels, "shift_labels": shift, "logits_to_keep": keep}
    got = patched(input_ids=ids, attention_mask=mask, **kwargs)
    want = stock(input_ids=ids, attention_mask=mask, **kwargs)
    got.loss.backward()
    want.loss.backward()
    assert_close(got.loss, want.loss, LOSS_RTOL, f"{variant} loss")
    assert_grads_close(patched, stock, GRAD_RTOL)


@pytest.mark.parametrize("family,tie", [("llama", True), ("gemma2", True), ("mistral", False)])
def test_adamw_steps_track_stock(family, tie):
    """Three AdamW steps on both models: equal losses, and parameters within 5% of the distance Adam moves them.

    Adam divides each gradient entry by its own RMS, so an entry whose gradient is ~1e-7 of the largest one moves
    by up to ``lr`` on fp32 rounding noise alone (we measured up to 1.5% of ``lr * steps``); parameters are
    therefore compared in units of the Adam step, not relative to their size.
    """
    patched, stock = build(family, tie=tie)
    lr, steps = 1e-2, 3
    start = {n: p.detach().clone() for n, p in stock.named_parameters()}
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1) for m in (patched, stock)]
    for i in range(steps):
        ids, mask, labels = make_batch(seed=10 + i)
        losses = []
        for model, opt in zip((patched, stock), opts):
            opt.zero_grad()
            losses.append(step(model, ids, mask, labels).loss)
            opt.step()
        assert_close(losses[0], losses[1], LOSS_RTOL, f"loss at step {i}")
    tol = 0.05 * lr * steps
    stock_params = dict(stock.named_parameters())
    for name, p in patched.named_parameters():
        q = stock_params[name]
        moved, diff = (q - start[name]).abs().max().item(), (p - q).abs().max().item()
        assert moved > 10 * tol, f"{name} moved only {moved:.2e}: the comparison below would be weak"
        assert diff <= tol, f"{name}: differs by {diff:.2e} after {steps} AdamW steps (> {tol:.1e})"
    assert (patched.lm_head.weight is patched.get_input_embeddings().weight) == tie


def test_without_labels_is_stock():
    patched, stock = build("llama", tie=True)
    ids, mask, _ = make_batch()
    got, want = patched(input_ids=ids, attention_mask=mask), stock(input_ids=ids, attention_mask=mask)
    assert got.loss is None and torch.equal(got.logits, want.logits)
    cache = "cache" if "cache" in type(got).__dataclass_fields__ else "past_key_values"  # 5.24 renamed it
    assert getattr(got, cache) is not None and type(getattr(got, cache)) is type(getattr(want, cache))
    prompt = ids[:1, :5]
    new = patched.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(new, stock.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0))


def test_return_dict_false_and_positional_args():
    patched, stock = build("qwen2")
    ids, mask, labels = make_batch()
    got = patched(ids, mask, return_dict=False, labels=labels)
    want = stock(ids, mask, return_dict=False, labels=labels)
    assert isinstance(got, tuple) and got[0].dim() == 0
    assert_close(got[0], want[0], LOSS_RTOL, "tuple loss")


def test_apply_is_idempotent_and_reversible():
    patched, stock = build("llama")
    forward = patched.forward
    assert inspect.signature(forward) == inspect.signature(stock.forward)  # Trainer reads it to pick columns
    assert vt.apply(patched, memory_budget="lean") is patched and patched.forward is forward
    ids, mask, labels = make_batch()
    assert_close(patched(input_ids=ids, attention_mask=mask, labels=labels).loss,
                 stock(input_ids=ids, attention_mask=mask, labels=labels).loss, LOSS_RTOL, "re-applied loss")
    vt.remove(patched)
    assert not vt.is_applied(patched) and "forward" not in patched.__dict__
    assert patched(input_ids=ids, attention_mask=mask, labels=labels).logits is not None
    vt.remove(patched)  # harmless twice


def test_all_labels_ignored_gives_zero_not_nan():
    """Documented difference: stock's mean over no tokens is NaN; vpce's is 0 with zero gradients."""
    patched, stock = build("llama")
    ids, mask, labels = make_batch()
    labels = torch.full_like(labels, -100)
    got, want = step(patched, ids, mask, labels), stock(input_ids=ids, attention_mask=mask, labels=labels)
    assert got.loss.item() == 0.0 and torch.isnan(want.loss)
    assert all(p.grad is None or not p.grad.any() for p in patched.parameters())


def test_logits_are_not_materialized():
    """Peak CPU memory of forward + backward stays far below one fp32 [tokens, vocab] logits tensor."""
    vocab, batch, seq = 8192, 16, 32  # short rows keep the eager attention scores small next to the logits
    ids, mask, labels = make_batch(vocab, batch, seq)
    patched, stock = build("llama", tie=True, vocab=vocab, memory_budget=2.0**-11)  # 0.5 MiB chunks
    logits_bytes = batch * seq * vocab * 4
    peaks = []
    for model in (patched, stock):
        with PeakMemory("cpu") as pm:
            step(model, ids, mask, labels)
        peaks.append(pm.peak)
    assert peaks[0] < logits_bytes / 2, f"patched peak {peaks[0] / 2**20:.1f} MiB, logits {logits_bytes / 2**20} MiB"
    assert peaks[1] >= logits_bytes, f"stock peak {peaks[1] / 2**20:.1f} MiB: control does not hold the logits"


def test_autocast_bf16():
    """Under autocast the lm_head operands are cast as nn.Linear would; bf16-level agreement, fp32 grads. The fp32
    lm_head weight goes to vpce uncast (vpce casts it inside its autograd Function): its gradient is the fast
    route's fp32 accumulator, not a bf16 gradient cast up as stock's is (HF Trainer's peak memory)."""
    patched, stock = build("llama")
    ids, mask, labels = make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = step(patched, ids, mask, labels), step(stock, ids, mask, labels)
    assert_close(got.loss, want.loss, 1e-2, "autocast loss")
    grad = patched.lm_head.weight.grad
    assert grad.dtype == torch.float32 and not torch.equal(grad, grad.bfloat16().float())
    assert torch.equal(stock.lm_head.weight.grad, stock.lm_head.weight.grad.bfloat16().float())  # the control
    assert_close(patched.lm_head.weight.grad, stock.lm_head.weight.grad, 5e-2, "autocast lm_head grad")


def test_stock_lm_head_runs_only_for_the_first_calls_probe(monkeypatch):
    """The stock forward gets a stand-in for lm_head's forward: the real one runs once, at the first call, on one
    position (the logits check), never again, so no cast of an fp32 lm_head is made under autocast (in autocast's
    cache it stayed beside vpce's own copy until the forward ended: 0.5 GiB of a 128k-vocab head at the HF step's
    peak). An instance forward (as accelerate's hooks set) is put back as it was; the losses stay
    stock's."""
    patched, stock = build("llama")
    head = patched.lm_head
    rows = []
    real = type(head).forward

    def counted(self, x):
        if self is head:
            rows.append(x.shape[-2])
        return real(self, x)

    monkeypatch.setattr(type(head), "forward", counted)
    own = lambda x: counted(head, x)  # noqa: E731
    head.forward = own
    for seed in (1, 2, 3):
        ids, mask, labels = make_batch(seed=seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = step(patched, ids, mask, labels), step(stock, ids, mask, labels)
        assert_close(got.loss, want.loss, 1e-2, f"loss, call with seed {seed}")
    assert rows == [1], rows
    assert head.forward is own
    del head.forward
    ids, mask, labels = make_batch(seed=4)
    assert_close(step(patched, ids, mask, labels).loss, step(stock, ids, mask, labels).loss, 1e-2, "after")
    assert rows == [1] and "forward" not in head.__dict__, rows


def test_apply_rejects_what_it_cannot_honour():
    patched, stock = build("llama")
    with pytest.raises(TypeError, match="expected a transformers causal LM"):
        vt.apply(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="expected keywords among"):
        vt.apply(stock, reduction="sum")
    with pytest.raises(ValueError, match="label_smoothing"):
        vt.apply(stock, label_smoothing=1.5)
    stock.loss_function = lambda *a, **k: 0.0
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        vt.apply(stock)
    assert not vt.is_applied(stock)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_aux_loss_is_stocks(family):
    """MoE families: vpce's loss is its cross-entropy plus ``router_aux_loss_coef * aux_loss``, as stock; the
    output's ``aux_loss`` and ``router_logits`` are stock's. Control: the cross-entropy alone differs."""
    patched, stock = build(family)
    ids, mask, labels = make_batch()
    got, want = step(patched, ids, mask, labels), step(stock, ids, mask, labels)
    assert want.aux_loss is not None and got.aux_loss is not None
    assert_close(got.aux_loss, want.aux_loss, LOSS_RTOL, "aux_loss")
    assert len(got.router_logits) == len(want.router_logits)
    assert_close(got.loss, want.loss, LOSS_RTOL, f"{family} loss with aux")
    assert_grads_close(patched, stock, GRAD_RTOL)
    err, _ = rel_err(got.loss - AUX_COEF * got.aux_loss, want.loss)
    assert err > 100 * LOSS_RTOL, f"the loss without the aux term is within {err:.1e} of stock's: weak test"
    off = patched(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False)
    assert off.aux_loss is None
    assert_close(off.loss, got.loss - AUX_COEF * got.aux_loss, LOSS_RTOL, "loss without router logits")


def test_refuses_a_logits_transform_it_does_not_reproduce():
    """The first forward checks stock's logits against vpce's transform: a soft cap in the config that Llama's
    forward does not apply is refused there, by name, before any loss is returned."""
    patched, stock = build("llama")
    patched.config.final_logit_softcapping = SOFTCAP  # vpce would cap; stock Llama does not
    ids, mask, labels = make_batch()
    with pytest.raises(TypeError, match="transforms lm_head's output in a way vpce does not reproduce"):
        patched(input_ids=ids, attention_mask=mask, labels=labels)
    patched.config.final_logit_softcapping = None
    assert_close(patched(input_ids=ids, attention_mask=mask, labels=labels).loss,
                 stock(input_ids=ids, attention_mask=mask, labels=labels).loss, LOSS_RTOL, "loss after the fix")


@pytest.mark.parametrize("name,match", [
    ("BartForCausalLM", "computes its loss with its own code"),
    ("BambaForCausalLM", "z-loss of its own"),
])
def test_refuses_a_forward_it_cannot_reproduce(name, match):
    """Classes whose forward is not ``self.loss_function`` of ``lm_head``'s logits are refused at ``apply``,
    naming the reason and the alternative (vpce.linear_cross_entropy on the hidden states)."""
    cls = getattr(transformers, name)
    model = cls.__new__(cls)  # only the class's forward and lm_head are read; nothing is run
    torch.nn.Module.__init__(model)
    model.config = transformers.PretrainedConfig()
    model.lm_head = torch.nn.Linear(4, 8)
    model.get_output_embeddings = lambda: model.lm_head
    with pytest.raises(TypeError, match=match) as info:
        vt.apply(model)
    assert "vpce.linear_cross_entropy" in str(info.value)


def test_refuses_a_head_that_is_not_linear():
    patched, stock = build("llama")
    stock.lm_head = torch.nn.Sequential(torch.nn.Linear(hf_models.D, V))
    with pytest.raises(TypeError, match="expected a torch.nn.Linear"):
        vt.apply(stock)


def test_training_forward_without_labels_warns_once():
    patched, _ = build("llama")
    ids, mask, _ = make_batch()
    with pytest.warns(UserWarning, match=r"built the \[tokens, vocab\] logits") as caught:
        patched(input_ids=ids, attention_mask=mask)
        patched(input_ids=ids, attention_mask=mask)
    assert len([w for w in caught if "vpce" in str(w.message)]) == 1
    patched.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        patched(input_ids=ids, attention_mask=mask)  # inference (generate): no warning


def test_docs_snippet_runs():
    """The snippet in docs/integrations.md, section "Hugging Face transformers", runs as written."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = text.split("## Hugging Face transformers", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "no python snippet in the Hugging Face transformers section"
    exec(compile(blocks[0], "docs/integrations.md", "exec"), {})
