"""``vpce.integrations.torchtune``: a training step of a tiny torchtune model against torchtune's own loss (CPU).

The released torchtune (0.6.x, what CI installs) is exercised through its real single-device SFT recipe: the
recipe file is loaded as ``tune run`` loads it, and its ``_loss_step`` (shift the labels with its ignore cache,
run the model, flatten, call the loss) runs twice on the same model and batch. Once it runs the way the recipe
sets up ``CEWithChunkedOutputLoss`` (``set_num_output_chunks``), and once with vpce's loss named by
``_component_`` and ``set_model_output``. Losses and every parameter gradient must agree to fp32 rounding, then
the parameters after two AdamW steps within 5% of the distance Adam moves
them. Negative controls show that the tolerances can fail.
"""

import contextlib
import copy
import importlib.util
import pathlib
import re
import runpy

import pytest
import torch

from compare import assert_close, assert_grads_close

torchtune = pytest.importorskip("torchtune")

from omegaconf import OmegaConf  # noqa: E402  (a torchtune dependency)
from torchtune import config  # noqa: E402
from torchtune.models.llama3 import llama3  # noqa: E402
from torchtune.models.llama3_2 import llama3_2  # noqa: E402
from torchtune.modules.peft import LoRALinear  # noqa: E402

from vpce.integrations import torchtune as vtt  # noqa: E402

V, D, B, S = 509, 32, 3, 17
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
COMPONENT = "vpce.integrations.torchtune.LinearCrossEntropyLoss"
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def build(tied: bool, seed: int = 0):
    """A tiny fp32 torchtune decoder: Llama 3 (untied ``nn.Linear`` output) or Llama 3.2 (``TiedLinear``)."""
    torch.manual_seed(seed)
    builder = llama3_2 if tied else llama3
    extra = {"tie_word_embeddings": True} if tied else {}
    model = builder(vocab_size=V, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=D, max_seq_len=64,
                    intermediate_dim=64, **extra)
    with torch.no_grad():  # wider than the default init, so that the logits spread and a wrong loss shows
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model


def make_batch(seed: int = 1):
    """tokens and labels [B, S]: row 1 right-padded (label -100), row 2 with a masked prompt, as SFT datasets."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    labels = tokens.clone()
    labels[1, -5:] = -100
    labels[2, :6] = -100
    return {"tokens": tokens, "labels": labels}


def recipe_class():
    """torchtune 0.6.x's ``FullFinetuneRecipeSingleDevice``, loaded from the file ``tune run`` executes."""
    spec = importlib.util.find_spec("torchtune")
    path = pathlib.Path(spec.origin).parents[1] / "recipes" / "full_finetune_single_device.py"
    if not path.is_file():
        pytest.skip(f"no torchtune recipe file at {path}")
    return runpy.run_path(str(path), run_name="torchtune_recipe")["FullFinetuneRecipeSingleDevice"]


def recipe_with(model, loss_cfg: dict):
    """The recipe object in the state its ``setup`` leaves for ``_loss_step``: model, loss, label-shift cache.

    The loss is instantiated from a config as ``setup`` does it; the model is set up for it as the 0.6.x recipe
    does for ``CEWithChunkedOutputLoss``, and as main's recipes do for an ``SFTLoss`` (``set_model_output``).
    """
    recipe = object.__new__(recipe_class())
    recipe._model = model
    recipe._loss_fn = config.instantiate(OmegaConf.create(loss_cfg))
    if recipe._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
        model.set_num_output_chunks(recipe._loss_fn.num_output_chunks)
    if hasattr(recipe._loss_fn, "set_model_output"):
        recipe._loss_fn.set_model_output(model)
    recipe.ignore_labels_cache = torch.full((B, 1), recipe._loss_fn.ignore_index)
    recipe.activations_handling_ctx = contextlib.nullcontext()
    return recipe


@pytest.mark.parametrize("tied", [False, True], ids=["llama3-linear", "llama3_2-tied"])
def test_recipe_training_step_matches_chunked_ce(tied):
    model = build(tied)
    stock_model = copy.deepcopy(model)
    ours = recipe_with(model, {"_component_": COMPONENT})
    stock = recipe_with(stock_model, {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"})
    assert isinstance(ours._loss_fn, vtt.LinearCrossEntropyLoss)

    start = {name: p.detach().clone() for name, p in stock_model.named_parameters()}
    lr, steps = 1e-2, 2
    optims = [torch.optim.AdamW(m.parameters(), lr=lr) for m in (model, stock_model)]
    for step in range(steps):
        losses = []
        for recipe in (ours, stock):
            batch = make_batch(seed=1 + step)  # _loss_step pops the labels: a fresh dict for each
            loss = recipe._loss_step(batch)
            loss.backward()
            losses.append(loss)
        assert_close(losses[0], losses[1], LOSS_RTOL, f"loss at step {step}")
        assert_grads_close(model, stock_model, GRAD_RTOL)
        for opt in optims:
            opt.step()
            opt.zero_grad()
    # Adam divides each gradient entry by its own RMS, so an entry with a ~0 gradient moves by up to lr on rounding
    # noise alone: compare parameters in units of the Adam step (as tests/integrations/test_integration_transformers.py does).
    tol = 0.05 * lr * steps
    for (name, p), q in zip(model.named_parameters(), stock_model.parameters()):
        moved, diff = (q - start[name]).abs().max().item(), (p - q).abs().max().item()
        assert moved > 10 * tol, f"{name} moved only {moved:.2e}: the comparison below would be weak"
        assert diff <= tol, f"{name}: differs by {diff:.2e} after {steps} AdamW steps (> {tol:.1e})"


def test_model_returns_hidden_states_and_state_dict_is_unchanged():
    model = build(tied=False)
    tokens = make_batch()["tokens"]
    keys = list(model.state_dict())
    with torch.no_grad():
        logits = model(tokens)
        loss_fn = vtt.LinearCrossEntropyLoss()
        loss_fn.set_model_output(model)
        hidden = model(tokens)
    assert hidden.shape == (B, S, D), hidden.shape
    assert_close(torch.nn.functional.linear(hidden, model.output.weight), logits, 1e-5, "output(hidden) vs logits")
    assert list(model.state_dict()) == keys
    assert list(loss_fn.state_dict()) == [] and list(loss_fn.parameters()) == []


def test_hidden_state_layout_of_main_recipes():
    """main's recipes pass ``[b, s, d]`` and labels the dataset already shifted; the loss takes both unflattened."""
    model = build(tied=True)
    loss_fn = vtt.LinearCrossEntropyLoss(label_smoothing=0.1)
    loss_fn.set_model_output(model)
    batch = make_batch()
    hidden = model(batch["tokens"])
    logits = torch.nn.functional.linear(hidden, model.tok_embeddings.weight)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), label_smoothing=0.1)
    assert_close(loss_fn(hidden, batch["labels"]), want, LOSS_RTOL, "loss on [b, s, d]")


def test_tolerances_can_fail():
    """Negative control: the same step with label smoothing or a z-loss is far outside the tolerance."""
    model = build(tied=False)
    stock_model = copy.deepcopy(model)
    stock = recipe_with(stock_model, {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"})
    want = stock._loss_step(make_batch())
    for cfg in ({"_component_": COMPONENT, "label_smoothing": 0.1}, {"_component_": COMPONENT, "z_loss": 1e-3}):
        got = recipe_with(copy.deepcopy(model), cfg)._loss_step(make_batch())
        with pytest.raises(AssertionError):
            assert_close(got, want, LOSS_RTOL, str(cfg))


def test_errors():
    model = build(tied=False)
    loss_fn = vtt.LinearCrossEntropyLoss()
    hidden = torch.randn(B, S, D)
    labels = make_batch()["labels"]
    with pytest.raises(RuntimeError, match="set_model_output"):
        loss_fn(hidden, labels)
    with pytest.raises(TypeError, match="options"):
        vtt.LinearCrossEntropyLoss(reduction="sum")
    with pytest.raises(ValueError):
        vtt.LinearCrossEntropyLoss(label_smoothing=2.0)

    chunked = copy.deepcopy(model)
    chunked.set_num_output_chunks(4)
    loss_fn.set_model_output(model)
    with pytest.raises(TypeError, match="CEWithChunkedOutputLoss"):
        loss_fn(chunked(make_batch()["tokens"]), labels)
    with pytest.raises(ValueError, match="output layer"):
        loss_fn(torch.randn(B, S, V), labels)  # logits where hidden states belong

    qlora = build(tied=False)
    qlora.output = LoRALinear(D, V, rank=4, alpha=8)
    qlora.output._quantize_base = True  # as QLoRA's builders make it (the NF4 weight itself needs torchao's kernels)
    with pytest.raises(TypeError, match="NF4"):
        vtt.LinearCrossEntropyLoss().set_model_output(qlora)


@pytest.mark.parametrize("dropout", [0.0, 0.25])
@pytest.mark.parametrize("disabled", [False, True])
def test_lora_on_the_output_layer_matches_the_stock_model(dropout, disabled):
    """``apply_lora_to_output``: the loss and every trainable gradient (LoRA's A and B on the output layer and the
    attention) equal the stock model's logits + cross-entropy, LoRA dropout on (the same mask: the loss draws it where
    the layer's forward would); the base weights stay frozen. A disabled adapter is the base layer."""
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(0)
    model = lora_llama3(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_output=True, vocab_size=V,
                        num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=D, max_seq_len=64, intermediate_dim=64,
                        lora_rank=4, lora_alpha=8.0, lora_dropout=dropout)
    with torch.no_grad():
        for p in model.parameters():  # LoRA's B starts at zero: give every term a value that shows in the loss
            p.normal_(0.0, 0.2)
    set_trainable_params(model, get_adapter_params(model))
    model.output.disabled = disabled
    stock = copy.deepcopy(model)
    batch = make_batch()
    labels = batch["labels"]

    loss_fn = vtt.LinearCrossEntropyLoss()
    loss_fn.set_model_output(model)
    torch.manual_seed(7)
    ours = loss_fn(model(batch["tokens"]), labels)
    torch.manual_seed(7)
    logits = stock(batch["tokens"])
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1), ignore_index=-100)
    ours.backward()
    ref.backward()
    assert_close(ours, ref, LOSS_RTOL, "loss")
    trainable = [n for n, p in stock.named_parameters() if p.requires_grad]
    assert any("output.lora_a" in n for n in trainable) and any("output.lora_b" in n for n in trainable)
    assert_grads_close(model, stock, GRAD_RTOL)
    assert model.output.weight.grad is None, "the frozen base weight got a gradient"
    if dropout and not disabled:  # control: another dropout mask moves the loss past the tolerance
        torch.manual_seed(8)
        other = loss_fn(model(batch["tokens"]), labels)
        assert abs(float(other) - float(ref)) > 10 * LOSS_RTOL * abs(float(ref))


def _docs_block(lang: str, after: str) -> str:
    """The first ```lang block after the line containing ``after`` in docs/integrations.md."""
    text = DOCS.read_text()
    start = text.index(after)
    match = re.search(rf"```{lang}\n(.*?)```", text[start:], re.S)
    assert match, f"no ```{lang} block after {after!r} in {DOCS.name}"
    return match.group(1)


def test_docs_snippet_runs():
    """docs/integrations.md's torchtune recipe config names this loss, and its Python snippet runs as written."""
    cfg = OmegaConf.create(_docs_block("yaml", "## torchtune"))
    loss_fn = config.instantiate(cfg.loss)
    assert isinstance(loss_fn, vtt.LinearCrossEntropyLoss), type(loss_fn)
    code = _docs_block("python", "tested-by: tests/integrations/test_integration_torchtune.py::test_docs_snippet_runs")
    exec(compile(code, "integrations.md:torchtune", "exec"), {"__name__": "__doc__"})
