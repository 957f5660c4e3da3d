"""``transformers.Trainer`` evaluation with a vpce-patched model: periodic evaluation inside ``train()`` with
``compute_metrics``, ``preprocess_logits_for_metrics``, ``predict()`` and label smoothing, against the unpatched
run (CPU, fp32, a tiny random Llama, no downloads).

The patched model returns the logits only where the Trainer keeps them (``prediction_step`` with
``prediction_loss_only=False``); its loss stays vpce's. A forward hook on ``lm_head`` records how many positions
each call projected: training steps project none (one, for the first call's check), so the logits are never built
there.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_models  # noqa: E402
from hf_models import V  # noqa: E402
from vpce.integrations.transformers import apply, is_applied  # noqa: E402

S, ROWS = 12, 12
LOSS_RTOL = 1e-5


def rows(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, V, (S,), generator=gen)
        mask = (torch.arange(S) < S - 2 * (i % 3)).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[: 1 + i % 2] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def metrics(prediction):
    """Next-token accuracy and mean max-logit over the labelled positions: both read the full logits."""
    logits, labels = prediction.predictions, prediction.label_ids
    logits, labels = torch.as_tensor(logits)[:, :-1], torch.as_tensor(labels)[:, 1:]
    keep = labels != -100
    if logits.dim() == 2:  # preprocess_logits_for_metrics gave argmax ids
        return {"accuracy": (logits[keep] == labels[keep]).double().mean().item()}
    return {"accuracy": (logits.argmax(-1)[keep] == labels[keep]).double().mean().item(),
            "max_logit": logits.max(-1).values[keep].double().mean().item()}


def argmax_ids(logits, labels):
    return logits.argmax(-1)


def trainer_for(model, tmp_path, name, **kwargs):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=4, per_device_train_batch_size=3, per_device_eval_batch_size=4,
        eval_strategy="steps", eval_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
        seed=0, data_seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        label_smoothing_factor=kwargs.pop("label_smoothing_factor", 0.0))
    return transformers.Trainer(model=model, args=args, train_dataset=rows(ROWS, 1), eval_dataset=rows(6, 2),
                                compute_metrics=metrics, **kwargs)


def evals(trainer):
    return [e for e in trainer.state.log_history if "eval_loss" in e]


def head_calls(model):
    """(training, positions projected) of every lm_head call."""
    calls = []
    model.lm_head.register_forward_hook(lambda m, args, out: calls.append((model.training, out.shape[-2])))
    return calls


def assert_same_evals(got, want):
    assert len(got) == len(want) == 2, (got, want)
    for g, w in zip(got, want):
        assert set(g) == set(w), (g, w)
        for key in ("eval_loss", "eval_accuracy", "eval_max_logit"):
            if key in w:
                assert abs(g[key] - w[key]) <= LOSS_RTOL * max(abs(w[key]), 1.0), f"{key}: vpce {g} stock {w}"


@pytest.mark.parametrize("how", ["apply(model)", "apply(trainer)", "preprocess_logits_for_metrics"])
def test_periodic_eval_with_compute_metrics_matches_stock(tmp_path, how):
    kwargs = {"preprocess_logits_for_metrics": argmax_ids} if how == "preprocess_logits_for_metrics" else {}
    model, stock = hf_models.pair("llama")
    calls = head_calls(model)
    if how == "apply(trainer)":
        trainer = apply(trainer_for(model, tmp_path, "vpce", **kwargs))
    else:
        trainer = trainer_for(apply(model), tmp_path, "vpce", **kwargs)
    trainer.train()
    reference = trainer_for(stock, tmp_path, "stock", **kwargs)
    reference.train()
    assert is_applied(trainer) and not is_applied(reference)
    assert_same_evals(evals(trainer), evals(reference))
    training = [n for is_training, n in calls if is_training]
    assert training and max(training) <= 1 and training.count(1) <= 1, f"training steps projected {training}"
    assert any(not is_training and n == S for is_training, n in calls), calls  # evaluation got the logits


def test_label_smoothing_with_eval_and_metrics_matches_stock(tmp_path):
    """apply(trainer) with label_smoothing_factor: the training and evaluation losses are those of stock's
    LabelSmoother, the metrics stock's. Control: unsmoothed evaluation losses differ."""
    model, stock = hf_models.pair("llama")
    trainer = apply(trainer_for(model, tmp_path, "vpce", label_smoothing_factor=0.1))
    assert trainer.label_smoother is None
    trainer.train()
    reference = trainer_for(stock, tmp_path, "stock", label_smoothing_factor=0.1)
    reference.train()
    assert_same_evals(evals(trainer), evals(reference))
    got = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    want = [e["loss"] for e in reference.state.log_history if "loss" in e]
    assert len(got) == len(want) == 4
    assert all(abs(g - w) <= LOSS_RTOL * abs(w) for g, w in zip(got, want)), (got, want)
    plain = trainer_for(hf_models.model("llama"), tmp_path, "plain")
    plain.train()
    worst = max(abs(p["eval_loss"] - w["eval_loss"]) / w["eval_loss"] for p, w in zip(evals(plain), evals(reference)))
    assert worst > 100 * LOSS_RTOL, f"smoothing moves eval_loss by only {worst:.1e}: weak test"


def test_predict_and_loss_only_evaluation(tmp_path):
    """predict() returns stock's logits and vpce's loss; evaluate() with prediction_loss_only builds no logits."""
    model, stock = hf_models.pair("llama")
    calls = head_calls(model)
    trainer = trainer_for(apply(model), tmp_path, "vpce")
    reference = trainer_for(stock, tmp_path, "stock")
    got, want = trainer.predict(rows(4, 3)), reference.predict(rows(4, 3))
    assert got.predictions.shape == want.predictions.shape == (4, S, V)
    err = abs(got.predictions - want.predictions).max() / abs(want.predictions).max()
    assert err <= LOSS_RTOL, f"predict() logits differ by {err:.1e}"
    assert abs(got.metrics["test_loss"] - want.metrics["test_loss"]) <= LOSS_RTOL * want.metrics["test_loss"]
    trainer.args.prediction_loss_only = True
    calls.clear()
    assert "eval_loss" in trainer.evaluate()
    assert calls and all(n == 0 for _, n in calls), calls
