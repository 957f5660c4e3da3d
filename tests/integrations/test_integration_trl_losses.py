"""``vpce.integrations.trl.apply(losses=True)``: TRL 1.16's ``GRPOTrainer`` and ``DPOTrainer`` computing their loss
with ``vpce.linear_grpo_loss`` / ``vpce.linear_dpo_loss`` (CPU, fp32).

Each case trains a tiny random Llama a few steps twice from the same weights, data and seed: TRL's own loss (on
TRL's head), then vpce's fused losses; every logged loss and metric must agree step by step. GRPO generates with
transformers on CPU (no vLLM) and scores with a reward function of the test; the cases cover DAPO with a KL term and
old log-probs (``steps_per_generation`` > accumulation), GSPO (sequence-level importance sampling) with gradient
accumulation and a temperature, and the compact layout of Triton devices (``_use_triton`` forced). A loss type that
is not fused falls back to TRL's with one warning naming it.
"""

import math
import warnings

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

import vpce  # noqa: E402
import vpce.integrations.trl as vtrl  # noqa: E402
import vpce.post_training as post_training  # noqa: E402
from test_integration_trl import DPO_DATA, phrase, tiny_llama, tokenizer  # noqa: E402

RTOL, ATOL = 2e-5, 2e-6
SKIP = ("step_time", "runtime", "per_second", "epoch", "learning_rate")  # timings, or not the trainers' numbers


def reward(completions, **kwargs):
    """A deterministic reward that varies within a group: the completions' token ids, mod 7."""
    return [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) % 7) for c in completions]


def tiny_mixtral(seed=0):
    """A tiny random MoE (Mixtral) whose trainers add the router's load-balancing loss."""
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                        router_aux_loss_coef=0.1, initializer_range=0.2, pad_token_id=0,
                                        eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config).float()


def train(kind, fused, tmp_path, steps=3, options=None, moe=False, **config):
    """Train ``steps`` steps with TRL's own loss (``fused=False``: TRL's head too) or vpce's fused losses; the
    logged entries, and how many times each fused loss ran."""
    vtrl.remove()
    runs = {"grpo": 0, "dpo": 0, "fused": 0}  # linear_grpo_loss, linear_dpo_loss, any (linear_log_prob_loss)
    if fused:
        vtrl.apply(**(options or {}))
    common = dict(output_dir=str(tmp_path / f"{kind}-{fused}"), max_steps=steps, learning_rate=3e-2,
                  lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no", seed=0,
                  data_seed=0, use_cpu=True, disable_tqdm=True, bf16=False)
    grpo_real, dpo_real = vpce.linear_grpo_loss, vpce.linear_dpo_loss
    fused_real = post_training._log_prob_loss

    def count(name, real):
        return lambda *a, **k: runs.__setitem__(name, runs[name] + 1) or real(*a, **k)

    vpce.linear_grpo_loss = count("grpo", grpo_real)
    vpce.linear_dpo_loss = count("dpo", dpo_real)
    post_training._log_prob_loss = count("fused", fused_real)
    try:
        if kind == "grpo":
            path = tmp_path / ("tiny-mixtral" if moe else "tiny-llama")
            if not path.exists():
                (tiny_mixtral() if moe else tiny_llama()).save_pretrained(path)
            data = datasets.Dataset.from_dict({"prompt": [phrase(i, 3) for i in range(8)]})
            trainer = trl.GRPOTrainer(model=str(path), reward_funcs=reward, train_dataset=data, eval_dataset=data,
                                      processing_class=tokenizer(),
                                      args=trl.GRPOConfig(**{**common, "max_completion_length": 6, **config}))
        else:
            make = tiny_mixtral if moe else tiny_llama
            trainer = trl.DPOTrainer(model=make(), ref_model=make(),
                                     train_dataset=datasets.Dataset.from_dict(DPO_DATA), processing_class=tokenizer(),
                                     args=trl.DPOConfig(**{**common, "per_device_train_batch_size": 4, **config}))
        trainer.train()
    finally:
        vpce.linear_grpo_loss, vpce.linear_dpo_loss = grpo_real, dpo_real
        post_training._log_prob_loss = fused_real
        vtrl.remove()
    logs = trainer.state.log_history
    train.evals = [e for e in logs if "eval_loss" in e]
    return [e for e in logs if "loss" in e and "train_runtime" not in e], runs


def compare(got, want, steps):
    assert len(got) == len(want) == steps
    for step, (g, w) in enumerate(zip(got, want), 1):
        keys = {k for k in w if not any(s in k for s in SKIP)}
        if all(abs(w.get(k, 1.0)) <= ATOL for k in ("rewards/chosen", "rewards/rejected")):
            # DPO's step 1 (policy = reference): every reward is roundoff, and so is which of a pair's is larger;
            # an AMD EPYC CPU's BLAS gave TRL 0.5 and vpce 0.25 there, both from differences of 1e-7
            keys.discard("rewards/accuracies")
        assert keys <= set(g), f"step {step}: metrics missing with vpce: {sorted(keys - set(g))}"
        for key in sorted(keys):
            if isinstance(w[key], float) and math.isnan(w[key]):
                assert math.isnan(g[key]), f"step {step} {key}: vpce {g[key]} vs TRL nan"
                continue
            # relative, with a floor for values at roundoff level (DPO's rewards at step 1: policy = reference)
            assert abs(g[key] - w[key]) <= RTOL * abs(w[key]) + ATOL, f"step {step} {key}: vpce {g[key]} vs TRL {w[key]}"


GRPO_CASES = {
    # DAPO with a KL term; steps_per_generation > accumulation: old log-probs from the sampling policy
    # and evaluations (the loss without accumulation, under no_grad)
    "dapo-kl-old": dict(loss_type="dapo", beta=0.04, per_device_train_batch_size=4, num_generations=4,
                        steps_per_generation=2, epsilon_high=0.28, eval_strategy="steps", eval_steps=2,
                        per_device_eval_batch_size=4),
    # GSPO: sequence-level importance sampling, two iterations per generation, accumulation, a temperature
    # and the adaptive entropy bonus (its controller, fed by vpce's entropies, turns it on after the first step)
    "gspo-accum": dict(use_adaptive_entropy=True, entropy_target=5.0, entropy_coef_delta=0.05,
                       loss_type="grpo", importance_sampling_level="sequence", per_device_train_batch_size=2,
                       num_generations=4, gradient_accumulation_steps=2, num_iterations=2, temperature=0.8,
                       epsilon=0.02, epsilon_high=0.04, learning_rate=1e-4),
    # SAPO with the off-policy sequence mask (old log-probs from steps_per_generation=2), VESPO, LUSPO with
    # sequence-level sampling and KL
    "sapo-opm": dict(loss_type="sapo", off_policy_mask_threshold=0.05, per_device_train_batch_size=4,
                     num_generations=4, steps_per_generation=2),
    "vespo": dict(loss_type="vespo", per_device_train_batch_size=4, num_generations=4, num_iterations=2),
    "luspo-seq-kl": dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.04,
                         per_device_train_batch_size=4, num_generations=4, num_iterations=2),
    # top-entropy masking (one process) with the entropy bonus over the kept tokens, and accumulation
    "top-entropy": dict(top_entropy_quantile=0.5, entropy_coef=0.05, loss_type="dapo", beta=0.04,
                        per_device_train_batch_size=2, num_generations=4, gradient_accumulation_steps=2),
    # a MoE: the router's auxiliary loss, scaled for accumulation as TRL does
    "moe-bnpo": dict(moe=True, loss_type="bnpo", per_device_train_batch_size=2, num_generations=4,
                     gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("case", list(GRPO_CASES) + ["dr_grpo-compact"])
def test_grpo_trainer_matches_trl_step_by_step(case, tmp_path, monkeypatch):
    config = GRPO_CASES.get(case) or dict(loss_type="dr_grpo", beta=0.02, per_device_train_batch_size=4,
                                          num_generations=4, num_iterations=2, delta=1.5,
                                          use_bias_correction_kl=False, entropy_coef=0.05)
    if case.endswith("compact"):  # the layout of Triton devices: only the valid tokens reach the head
        monkeypatch.setattr(trl.trainer.utils, "_use_triton", lambda device: True)
    want, runs = train("grpo", False, tmp_path, **config)
    want_evals = train.evals
    assert runs["fused"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback
        got, runs = train("grpo", True, tmp_path, **config)
    assert runs["fused"] >= 3, "vpce's GRPO loss did not run"
    assert runs["grpo"] >= 3  # every loss type goes through the public linear_grpo_loss
    compare(got, want, 3)
    if "eval_strategy" in config:
        assert len(want_evals) >= 1
        compare(train.evals, want_evals, len(want_evals))
    if case == "dapo-kl-old":
        assert any(w["kl"] > 0 for w in want)
    if case == "moe-bnpo":
        assert all(w["aux_loss"] > 0 for w in want)


@pytest.mark.parametrize("config", [dict(loss_type=["sigmoid"]), dict(loss_type=["ipo"], beta=0.2),
                                    dict(loss_type=["hinge"], precompute_ref_log_probs=True),
                                    dict(loss_type=["sigmoid"], loss_weights=[0.5], moe=True),
                                    dict(loss_type=["sigmoid", "robust", "sft"], loss_weights=[0.8, 0.2, 1.0],
                                         label_smoothing=0.1, f_divergence_type="js_divergence", ld_alpha=0.5),
                                    dict(loss_type=["aot", "sigmoid_norm"], label_smoothing=0.1)],
                         ids=["sigmoid", "ipo", "hinge-precomputed", "moe-weighted", "mixed-js-ld", "aot-norm"])
def test_dpo_trainer_matches_trl_step_by_step(config, tmp_path):
    want, runs = train("dpo", False, tmp_path, **config)
    assert runs["dpo"] == 0
    got, runs = train("dpo", True, tmp_path, **config)
    assert runs["dpo"] >= 3, "vpce's DPO loss did not run"
    compare(got, want, 3)
    assert max(e["mean_token_accuracy"] for e in want) > 0
    if config.get("moe"):
        assert all(w["aux_loss"] > 0 for w in want)


def test_dpo_without_logit_metrics(tmp_path):
    """``dpo_logit_metrics=False``: no pass for ``mean_logits`` and ``is_top1``; their metrics are not logged, the
    others are TRL's."""
    want, _ = train("dpo", False, tmp_path, steps=2)
    got, runs = train("dpo", True, tmp_path, steps=2, options=dict(dpo_logit_metrics=False))
    assert runs["dpo"] >= 2
    dropped = ("logits/chosen", "logits/rejected", "mean_token_accuracy")
    assert not any(k in g for g in got for k in dropped)
    compare(got, [{k: v for k, v in w.items() if k not in dropped} for w in want], 2)


def test_unsupported_loss_falls_back_with_one_warning(tmp_path):
    config = dict(use_weighting=True)
    want, _ = train("dpo", False, tmp_path, steps=2, **config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, runs = train("dpo", True, tmp_path, steps=2, **config)
    ours = [str(w.message) for w in caught if "vpce.integrations.trl" in str(w.message)]
    assert len(ours) == 1 and "use_weighting" in ours[0] and "DPOTrainer" in ours[0], ours
    assert runs["fused"] == 0
    compare(got, want, 2)  # TRL's loss on vpce's head


def test_losses_option_and_remove():
    from trl import DPOTrainer, GRPOTrainer

    originals = GRPOTrainer._compute_loss, DPOTrainer._compute_loss
    vtrl.apply()
    try:
        assert GRPOTrainer._compute_loss is not originals[0] and DPOTrainer._compute_loss is not originals[1]
        vtrl.apply(losses=False)
        assert (GRPOTrainer._compute_loss, DPOTrainer._compute_loss) == originals and vtrl.is_applied()
        vtrl.apply(dpo_logit_metrics=False)
        with pytest.raises(TypeError, match="losses"):
            vtrl.apply(losses="yes")
    finally:
        vtrl.remove()
    assert (GRPOTrainer._compute_loss, DPOTrainer._compute_loss) == originals and not vtrl.is_applied()
