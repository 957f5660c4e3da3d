"""PEFT models through ``vpce.integrations.transformers.apply``: LoRA, DoRA and ``modules_to_save``, on attention
and on ``lm_head``, against the unpatched PEFT model (CPU, fp32, tiny random models built from configs).

Each case builds one PEFT model, gives its LoRA ``B`` matrices random values (PEFT starts them at zero, which would
hide a missing adapter term), deep-copies it, patches one copy, and compares the loss and the gradient of every
parameter: trainable ones to fp32 rounding, frozen ones without a gradient in both. LoRA dropout stays on: both
copies draw from the same seed, so they see the same mask only if vpce draws it as PEFT does (the control shows
the mask matters by more than the tolerance).
"""

import copy

import pytest
import torch

from compare import assert_close, assert_grads_close, rel_err

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import hf_models  # noqa: E402
from hf_models import V  # noqa: E402
from vpce.integrations import transformers as vt  # noqa: E402

B, S = 3, 13
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
ATTENTION = ["q_proj", "v_proj"]


def peft_pair(config, family: str = "llama", tie: bool = False, seed: int = 0):
    """(patched, stock): a PEFT model of a tiny ``family`` model with random LoRA B matrices, and a deep copy."""
    model = peft.get_peft_model(hf_models.model(family, tie=tie, seed=seed), config)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    stock = copy.deepcopy(model)
    return vt.apply(model), stock


def batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[-1, :3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seeded(model, inputs, seed: int = 5):
    torch.manual_seed(seed)  # the same LoRA dropout masks in both models
    out = model(**inputs)
    out.loss.backward()
    return out


def check_against_stock(patched, stock, steps: int = 2):
    for step in range(steps):
        inputs = batch(seed=step + 1)
        got, want = seeded(patched, inputs, seed=10 + step), seeded(stock, inputs, seed=10 + step)
        assert got.logits is None and want.logits is not None
        assert_close(got.loss, want.loss, LOSS_RTOL, f"loss at step {step}")
    assert_grads_close(patched, stock, GRAD_RTOL)
    for name, p in patched.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"{name} is frozen but got a gradient"


LM_HEAD = ATTENTION + ["lm_head"]
CONFIGS = {
    "lora-attention": dict(target_modules=ATTENTION, lora_dropout=0.1),
    "lora-lm_head": dict(target_modules=LM_HEAD, lora_dropout=0.1),
    "lora-lm_head-no-dropout": dict(target_modules=LM_HEAD, lora_dropout=0.0),
    "lora-lm_head-bias": dict(target_modules=LM_HEAD, lora_dropout=0.1, lora_bias=True),
    "dora-lm_head": dict(target_modules=LM_HEAD, lora_dropout=0.1, use_dora=True),
    "dora-lm_head-no-dropout": dict(target_modules=LM_HEAD, lora_dropout=0.0, use_dora=True),
    "rslora-lm_head": dict(target_modules=LM_HEAD, lora_dropout=0.1, use_rslora=True),
    "modules_to_save-lm_head": dict(target_modules=ATTENTION, modules_to_save=["lm_head"]),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT: lora_bias on a head without a bias
@pytest.mark.parametrize("name", list(CONFIGS))
def test_lora_matches_the_unpatched_peft_model(name):
    config = peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **CONFIGS[name])
    patched, stock = peft_pair(config)
    assert vt.is_applied(patched) and not vt.is_applied(stock)
    check_against_stock(patched, stock)


@pytest.mark.parametrize("family", ["gemma2", "phi", "qwen2_moe"])
def test_lora_on_lm_head_across_families(family):
    """A soft-capped head (Gemma 2), a head with a bias (Phi), a router aux loss (Qwen2-MoE)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], lora_dropout=0.1)
    patched, stock = peft_pair(config, family)
    check_against_stock(patched, stock)


def test_tied_lm_head_keeps_its_tie_and_trains_the_shared_weight():
    """A tied head: the LoRA base weight stays the embedding's; trained (PEFT's modules_to_save on the embedding
    keeps it trainable), its gradient sums both uses, as stock's."""
    config = peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"], lora_dropout=0.1)
    patched, stock = peft_pair(config, tie=True)
    for model in (patched, stock):
        model.get_base_model().get_input_embeddings().weight.requires_grad_(True)
    base = patched.get_base_model()
    assert base.lm_head.get_base_layer().weight is base.get_input_embeddings().weight
    check_against_stock(patched, stock)
    assert base.get_input_embeddings().weight.grad is not None
    assert base.lm_head.get_base_layer().weight is base.get_input_embeddings().weight


def test_dropout_mask_matters_control():
    """The same model in eval mode (no dropout) logs another loss: the dropout comparison above is not vacuous."""
    config = peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.3)
    patched, stock = peft_pair(config)
    inputs = batch()
    torch.manual_seed(0)
    train_loss = stock(**inputs).loss
    stock.eval()
    err, _ = rel_err(stock(**inputs).loss, train_loss)
    assert err > 100 * LOSS_RTOL, f"dropout moves the loss by only {err:.1e}: weak test"
    patched.eval()
    with torch.no_grad():
        assert_close(patched(**inputs).loss, stock(**inputs).loss, LOSS_RTOL, "eval-mode loss")


def test_disabled_and_merged_adapters():
    config = peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.0)
    patched, stock = peft_pair(config)
    inputs = batch()
    with patched.disable_adapter(), stock.disable_adapter():
        assert_close(patched(**inputs).loss, stock(**inputs).loss, LOSS_RTOL, "disabled adapter")
    patched.merge_adapter()
    stock.merge_adapter()
    assert_close(patched(**inputs).loss, stock(**inputs).loss, LOSS_RTOL, "merged adapter")


def test_unwraps_and_removes():
    config = peft.LoraConfig(r=4, target_modules=["lm_head"])
    patched, _ = peft_pair(config)
    assert "forward" in patched.get_base_model().__dict__
    assert vt.remove(patched) is patched and not vt.is_applied(patched)
    assert "forward" not in patched.get_base_model().__dict__
    assert patched(**batch()).logits is not None


def test_refuses_what_it_cannot_reproduce():
    """Mixed-adapter batches (``adapter_names=``) and trainable-token heads are refused by name."""
    config = peft.LoraConfig(r=4, target_modules=["lm_head"])
    patched, _ = peft_pair(config)
    patched.eval()  # PEFT takes adapter_names in eval mode only
    with torch.no_grad(), pytest.raises(TypeError, match="mixed-adapter batches"):
        patched(**batch(), adapter_names=["default"] * B)
    model = peft.get_peft_model(hf_models.model("llama"),
                                peft.LoraConfig(r=4, target_modules=ATTENTION,
                                                trainable_token_indices={"lm_head": [3, 5]}))
    with pytest.raises(TypeError, match="model.lm_head: expected"):
        vt.apply(model)


def test_trainer_trains_a_peft_model_as_stock(tmp_path):
    """Trainer with a PEFT model (LoRA on attention and lm_head, dropout on): apply(trainer) logs stock's losses and
    gradient norms step by step."""
    config = peft.LoraConfig(r=4, target_modules=LM_HEAD, lora_dropout=0.1)
    patched, stock = peft_pair(config)
    vt.remove(patched)
    rows = [{k: v[i] for k, v in batch(seed=s).items()} for s in range(3) for i in range(B)]

    def logged(model, name, patch):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=3, learning_rate=1e-2,
            logging_steps=1, report_to=[], save_strategy="no", seed=0, data_seed=0, use_cpu=True,
            dataloader_num_workers=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        if patch:
            vt.apply(trainer)
            assert vt.is_applied(trainer)
        trainer.train()
        return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]

    got, want = logged(patched, "vpce", True), logged(stock, "stock", False)
    assert len(got) == len(want) == 3, (got, want)
    for (loss, norm), (stock_loss, stock_norm) in zip(got, want):
        assert abs(loss - stock_loss) <= LOSS_RTOL * abs(stock_loss), (got, want)
        assert abs(norm - stock_norm) <= 1e-4 * abs(stock_norm), (got, want)


def test_trl_sft_with_peft_config_matches_trls_own_head(tmp_path):
    """TRL's SFTTrainer with ``peft_config=`` (LoRA on attention; TRL itself refuses LoRA on lm_head, whose
    log-probs it reads from ``lm_head.weight``): vpce's head (``vpce.integrations.trl``) logs TRL's losses,
    gradient norms and token accuracy step by step."""
    trl = pytest.importorskip("trl", minversion="1.16")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    import vpce.integrations.trl as vtrl

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(V - 3)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                     unk_token="<unk>")
    words = [" ".join(f"w{(i + 2 * j) % (V - 3)}" for j in range(3 + i % 4)) for i in range(8)]
    data = datasets.Dataset.from_dict({"prompt": words, "completion": words[::-1]})

    def train(head):
        vtrl.remove()
        if head == "vpce":
            vtrl.apply(losses=False)
        model = hf_models.model("llama", pad_token_id=0, eos_token_id=1, bos_token_id=1)
        args = trl.SFTConfig(output_dir=str(tmp_path / head), max_steps=3, per_device_train_batch_size=4,
                             learning_rate=3e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                             data_seed=0, use_cpu=True, disable_tqdm=True, bf16=False)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, lora_dropout=0.0)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                 peft_config=config)
        try:
            trainer.train()
        finally:
            vtrl.remove()
        return [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]

    got, want = train("vpce"), train("trl")
    assert len(got) == len(want) == 3, (got, want)
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "mean_token_accuracy"):
            assert abs(g[key] - w[key]) <= 2e-5 * max(abs(w[key]), 1.0), f"{key}: vpce {g} TRL {w}"
