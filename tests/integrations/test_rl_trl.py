"""``vpce.integrations.trl`` on the configurations production runs hit, each against TRL 1.16's own
``_compute_loss`` on the same model, batch and state: GRPO with the vLLM importance-sampling correction (every
``vllm_importance_sampling_mode``; the generation itself needs vLLM, so the batch that TRL's generation step
produces is built here, with TRL's formula for the ratio) and with ``top_entropy_quantile``, fused with no fallback;
DPO ``ipo`` where a completion starts at position 0 (an empty prompt, no BOS). Loss and every parameter's gradient
must agree (CPU, fp32).
"""

import warnings

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

import vpce  # noqa: E402
import vpce.integrations.trl as vtrl  # noqa: E402
from test_integration_trl import DPO_DATA, V, phrase, tiny_llama, tokenizer  # noqa: E402
from test_rl_grpo import is_ratio_trl  # noqa: E402

B, P, C = 4, 3, 6  # completions, prompt and completion lengths


def common(tmp_path, name):
    return dict(output_dir=str(tmp_path / name), report_to=[], save_strategy="no", use_cpu=True,
                disable_tqdm=True, bf16=False, seed=0)


def reward(completions, **kwargs):
    return [0.0] * len(completions)


def grpo_trainer(tmp_path, **config):
    data = datasets.Dataset.from_dict({"prompt": [phrase(i, 3) for i in range(8)]})
    args = trl.GRPOConfig(**common(tmp_path, "grpo"), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=C, **config)
    path = tmp_path / "tiny-llama"
    if not path.exists():
        tiny_llama().save_pretrained(path)
    trainer = trl.GRPOTrainer(model=str(path), reward_funcs=reward, train_dataset=data,
                              processing_class=tokenizer(), args=args)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # as the training loop sets it: accumulation in the normalizers
    return trainer


def grpo_batch(mode=None, clip=(None, 3.0), beta=0.0, seed=0):
    """What ``_generate_and_score_completions`` hands ``_compute_loss`` (one process): old, sampler and reference
    log-probs near the policy's, and with ``mode`` TRL's vLLM ratio of them."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, V, (B, P), generator=gen)
    completion_ids = torch.randint(3, V, (B, C), generator=gen)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    base = -4.0 + torch.randn(B, C, generator=gen) * 0.5
    old = base + (torch.rand(B, C, generator=gen) - 0.5) * 0.6
    sampling = old + (torch.rand(B, C, generator=gen) - 0.5) * 0.8
    sampling[0, 2] = float("nan")
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones(B, P, dtype=torch.long),
                  completion_ids=completion_ids, completion_mask=completion_mask,
                  advantages=torch.randn(B, generator=gen), old_per_token_logps=old,
                  sampling_per_token_logps=sampling, num_items_in_batch=completion_mask.sum())
    if beta:
        inputs["ref_per_token_logps"] = base + torch.randn(B, C, generator=gen) * 0.3
    if mode is not None:
        inputs["importance_sampling_ratio"] = is_ratio_trl(old, sampling, completion_mask, mode, *clip)
    return inputs


def loss_and_grads(trainer, inputs, fused):
    """``_compute_loss``'s loss and every parameter's gradient, with TRL's loss (``fused=False``) or vpce's."""
    vtrl.remove()
    if fused:
        vtrl.apply()
    trainer.model.zero_grad(set_to_none=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no fallback
            loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
    finally:
        vtrl.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def assert_same(got, want, rtol=2e-5, atol=1e-7):
    (loss, grads), (loss_w, grads_w) = got, want
    assert torch.isfinite(loss_w) and abs(float(loss) - float(loss_w)) <= rtol * abs(float(loss_w)) + atol, \
        f"loss: vpce {float(loss)} vs TRL {float(loss_w)}"
    assert grads.keys() == grads_w.keys() and grads_w
    for name, g in grads_w.items():
        err = (grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-12)
        assert err <= 1e-4, f"{name}: max err {float(err):.2e} of its largest entry"


GRPO_VLLM = {  # id: (GRPOConfig keywords, vLLM mode, clip bounds)
    "dapo-kl-token_truncate": (dict(loss_type="dapo", beta=0.04), "token_truncate", (0.7, 1.2)),
    "dapo-token_mask": (dict(loss_type="dapo"), "token_mask", (0.8, 1.2)),
    "grpo-sequence_truncate": (dict(loss_type="grpo"), "sequence_truncate", (None, 1.1)),
    "gspo-kl-sequence_mask": (dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
                              "sequence_mask", (0.5, 1.3)),
    "sapo-token_truncate": (dict(loss_type="sapo"), "token_truncate", (None, 1.2)),
    "vespo-token_mask": (dict(loss_type="vespo"), "token_mask", (0.8, 1.2)),
    "cispo-opm-sequence_mask": (dict(loss_type="cispo", off_policy_mask_threshold=0.02), "sequence_mask",
                                (None, 3.0)),
    "top-entropy-bonus-token_mask": (dict(loss_type="bnpo", top_entropy_quantile=0.4, entropy_coef=0.1,
                                          beta=0.04), "token_mask", (0.8, 1.2)),
}


@pytest.mark.parametrize("case", list(GRPO_VLLM))
def test_grpo_vllm_importance_sampling_fused(case, tmp_path):
    config, mode, clip = GRPO_VLLM[case]
    trainer = grpo_trainer(tmp_path, vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip[0],
                           vllm_importance_sampling_clip_max=clip[1], **config)
    # the generation step's vLLM: not on CPU; its batch is built here, the trainer told it used vLLM
    trainer.use_vllm = True
    assert trainer.vllm_importance_sampling_correction
    inputs = grpo_batch(mode, clip, beta=config.get("beta", 0.0))
    ratio = inputs["importance_sampling_ratio"]
    assert (ratio != 1).any()
    if mode.endswith("mask") and clip != (None, 3.0):
        assert (ratio == 0).any() and (ratio != 0).any(), "the mask mode must drop some and keep some"
    want = loss_and_grads(trainer, inputs, fused=False)
    calls = []
    real = vpce.linear_grpo_loss
    vpce.linear_grpo_loss = lambda *a, **k: calls.append(k) or real(*a, **k)
    try:
        got = loss_and_grads(trainer, inputs, fused=True)
    finally:
        vpce.linear_grpo_loss = real
    assert len(calls) == 1
    assert ("importance_sampling_ratio" in calls[0]), "the correction must reach vpce's loss"
    assert_same(got, want)
    # without the correction the loss differs: the test can fail
    trainer.vllm_importance_sampling_correction = False
    if config["loss_type"] != "vespo":
        plain = loss_and_grads(trainer, inputs, fused=False)
        assert abs(float(plain[0]) - float(want[0])) > 1e-6


def test_grpo_top_entropy_quantile_fused(tmp_path):
    trainer = grpo_trainer(tmp_path, loss_type="dapo", top_entropy_quantile=0.3, beta=0.04)
    inputs = grpo_batch(beta=0.04)
    calls = []
    real = vpce.linear_grpo_loss
    vpce.linear_grpo_loss = lambda *a, **k: calls.append(k) or real(*a, **k)
    try:
        got = loss_and_grads(trainer, inputs, fused=True)
    finally:
        vpce.linear_grpo_loss = real
    assert len(calls) == 1 and calls[0]["top_entropy_quantile"] == 0.3
    assert_same(got, loss_and_grads(trainer, inputs, fused=False))


def test_dpo_ipo_with_a_completion_at_position_zero(tmp_path):
    """An empty prompt, no BOS: TRL divides each log-ratio by ``completion_mask.sum()``, which counts the first
    token though nothing predicts it."""
    args = trl.DPOConfig(**common(tmp_path, "dpo"), per_device_train_batch_size=2, loss_type=["ipo"], beta=0.2)
    trainer = trl.DPOTrainer(model=tiny_llama(), ref_model=tiny_llama(1),
                             train_dataset=datasets.Dataset.from_dict(DPO_DATA), processing_class=tokenizer(),
                             args=args)
    trainer.model.train()
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, V, (4, 8), generator=gen)
    completion_mask = torch.ones(4, 8, dtype=torch.long)
    completion_mask[1, :3] = 0  # a prompt of 3
    completion_mask[2, 6:] = 0  # padding
    attention_mask = torch.ones(4, 8, dtype=torch.long)
    attention_mask[2, 6:] = 0
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask)

    calls = []
    real = vpce.linear_dpo_loss

    def run(fused):
        vtrl.remove()
        if fused:
            vtrl.apply()
        trainer.model.zero_grad(set_to_none=True)
        vpce.linear_dpo_loss = lambda *a, **k: calls.append(k) or real(*a, **k)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # no fallback
                loss = trainer._compute_loss(trainer.model, inputs, False)
            loss.backward()
        finally:
            vtrl.remove()
            vpce.linear_dpo_loss = real
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    assert_same(run(True), run(False))
    assert len(calls) == 1
