"""Small things a new user meets first: what a loss module shows, what ``--help`` says, what the demo prints."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_torchtune_loss_repr_shows_its_options():
    pytest.importorskip("torchtune")
    from vpce.integrations.torchtune import LinearCrossEntropyLoss

    text = repr(LinearCrossEntropyLoss(ignore_index=-1, memory_budget="lean", label_smoothing=0.1))
    for part in ("ignore_index=-1", "memory_budget='lean'", "label_smoothing=0.1", "set_model_output"):
        assert part in text, text


def test_bench_help_gives_each_default_once():
    from vpce.bench.cli import build_parser

    text = build_parser().format_help()
    assert "(default: None)" not in text
    rep_time = re.search(r"\n  --rep-time REP_TIME(.*?)\n  --", text, flags=re.S).group(1)
    assert rep_time.count("default") == 1, rep_time


def test_demo_explains_its_chunk_budget():
    source = (ROOT / "launch" / "demo.py").read_text()
    line = source[source.index("vpce chunk budget {cfg.loss_chunk_mib"):].split(":\")", 1)[0]
    assert "memory_budget" in line and "default" in line, line


def test_second_backward_message_names_every_way_out():
    """vpce.nn's default fast route hands its gradients out once; the error for a second backward says how to get
    one (the lean budget, vpce.nn's allow_retain_graph option) instead of naming only one of them."""
    import torch

    import vpce.nn

    torch.manual_seed(0)
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    loss = vpce.nn.linear_cross_entropy(h, w, torch.randint(0, 11, (6,)), memory_budget="fast")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError) as e:
        loss.backward()
    for part in ("memory_budget='lean'", "allow_retain_graph=True", "second backward"):
        assert part in str(e.value), str(e.value)


def test_hopper_hint_is_said_once_and_can_be_silenced():
    """On an sm_90 GPU without the `hopper` extra the fast route says once per process how to get the faster path;
    the warning's category turns it off."""
    import warnings

    import vpce
    from vpce.backends import gemm

    gemm._suggest_hopper_extra.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gemm._suggest_hopper_extra()
        gemm._suggest_hopper_extra()
    hints = [w for w in seen if issubclass(w.category, vpce.HopperExtraWarning)]
    assert len(hints) == 1, [str(w.message) for w in seen]
    assert "pip install 'vpce[hopper]'" in str(hints[0].message)
    gemm._suggest_hopper_extra.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=vpce.HopperExtraWarning)
        gemm._suggest_hopper_extra()
    assert not seen, [str(w.message) for w in seen]
