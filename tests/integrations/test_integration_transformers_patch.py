"""``vpce.integrations.transformers.patch`` (before loading) and ``VpceAutoModelForCausalLM``: models built after
the call come back patched, by model type, class name, class, or all; ``remove`` undoes it (CPU, fp32, tiny
configs, ``from_config`` and ``from_pretrained`` of a local directory, no downloads)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402
from compare import assert_close, assert_grads_close  # noqa: E402
from vpce.integrations import transformers as vt  # noqa: E402

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


@pytest.fixture(autouse=True)
def unpatched():
    """Every test starts and ends with no class-level patch (post_init as transformers ships it)."""
    original = transformers.PreTrainedModel.post_init
    vt.remove()
    yield
    vt.remove()
    assert transformers.PreTrainedModel.post_init is original


def batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf_models.V, (2, 11), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def check_matches_stock(model, family):
    """``model`` (built under a patch) against an unpatched model of the same weights."""
    stock = vt.remove(hf_models.model(family))  # built under the same patch: made stock again
    stock.load_state_dict(model.state_dict())
    assert vt.is_applied(model) and not vt.is_applied(stock)
    got, want = model(**batch()), stock(**batch())
    got.loss.backward()
    want.loss.backward()
    assert got.logits is None
    assert_close(got.loss, want.loss, LOSS_RTOL, "loss")
    assert_grads_close(model, stock, GRAD_RTOL)


@pytest.mark.parametrize("target", ["llama", "LlamaForCausalLM", transformers.LlamaForCausalLM],
                         ids=["model-type", "class-name", "class"])
def test_patch_takes_effect_for_models_built_afterwards(target):
    before = hf_models.model("llama")
    vt.patch(target, memory_budget="lean")
    model = hf_models.model("llama")
    assert not vt.is_applied(before), "a model built before patch() stays stock"
    assert not vt.is_applied(hf_models.model("qwen2")), "another family is not a target"
    assert model.__dict__["_vpce_patch"].options == {"memory_budget": "lean"}
    check_matches_stock(model, "llama")
    vt.remove(target)
    assert not vt.is_applied(hf_models.model("llama"))
    assert vt.is_applied(model)  # built under the patch: remove(model) undoes it
    vt.remove(model)
    assert not vt.is_applied(model)


def test_patch_all_and_unsupported_models_stay_stock_with_a_warning():
    vt.patch()
    for family in ("qwen3", "gemma2", "mixtral", "phi"):
        model = hf_models.model(family)
        assert vt.is_applied(model), family
    check_matches_stock(hf_models.model("gemma2"), "gemma2")
    assert not vt.is_applied(transformers.LlamaModel(hf_models.config("llama")))  # no lm_head: not a causal LM
    config = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=32)
    with pytest.warns(UserWarning, match="BartForCausalLM is left stock: .*own code"):
        bart = transformers.BartForCausalLM(config)
    assert not vt.is_applied(bart)
    vt.remove()
    assert not vt.is_applied(hf_models.model("qwen3"))


def test_patch_named_class_it_cannot_honour_raises_at_construction():
    vt.patch("BartForCausalLM")
    config = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=32)
    with pytest.raises(TypeError, match="computes its loss with its own code"):
        transformers.BartForCausalLM(config)


def test_patch_then_from_pretrained_and_from_config(tmp_path):
    hf_models.model("qwen2").save_pretrained(tmp_path / "qwen2")
    vt.patch("qwen2")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen2")
    assert vt.is_applied(loaded)
    loaded.train()
    check_matches_stock(loaded, "qwen2")
    assert vt.is_applied(transformers.AutoModelForCausalLM.from_config(hf_models.config("qwen2")))


def test_auto_loader(tmp_path):
    hf_models.model("llama").save_pretrained(tmp_path / "llama")
    model = vt.VpceAutoModelForCausalLM.from_pretrained(tmp_path / "llama", z_loss=1e-4)
    assert vt.is_applied(model) and model.__dict__["_vpce_patch"].options == {"z_loss": 1e-4}
    assert type(model) is transformers.LlamaForCausalLM
    model = vt.VpceAutoModelForCausalLM.from_config(hf_models.config("llama"))
    torch.manual_seed(0)
    model.load_state_dict(hf_models.model("llama").state_dict())
    check_matches_stock(model, "llama")


def test_patch_then_peft():
    peft = pytest.importorskip("peft")
    vt.patch("llama")
    model = peft.get_peft_model(hf_models.model("llama"), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    assert vt.is_applied(model)
    vt.remove()
    stock = peft.get_peft_model(hf_models.model("llama"), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    stock.load_state_dict(model.state_dict())
    assert_close(model(**batch()).loss, stock(**batch()).loss, LOSS_RTOL, "PEFT model built under patch()")


def test_patch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="expected a transformers model type"):
        vt.patch("not-a-model-type")
    with pytest.raises(TypeError, match="expected transformers model classes"):
        vt.patch(torch.nn.Linear)
    with pytest.raises(TypeError, match="expected keywords among"):
        vt.patch("llama", reduction="sum")
    with pytest.raises(ValueError, match="label_smoothing"):
        vt.patch("llama", label_smoothing=2.0)
    assert transformers.PreTrainedModel.post_init.__name__ == "post_init" and not vt.is_applied(
        hf_models.model("llama"))
