"""Bad input gets a ValueError/TypeError that names the argument, what was expected and what was given."""

import pytest
import torch

import vpce


def good(**over):
    args = dict(hidden=torch.randn(6, 8), weight=torch.randn(20, 8), target=torch.randint(0, 20, (6,)))
    args.update(over)
    return args


CASES = [
    # (overrides, error type, substrings the message must hold)
    ({"hidden": [[1.0]]}, TypeError, ["hidden", "torch.Tensor", "list"]),
    ({"weight": torch.randn(20, 8, 1)}, ValueError, ["weight", "[V_local, D]", "(20, 8, 1)"]),
    ({"weight": torch.randn(20, 7)}, ValueError, ["weight", "[V_local, 8]", "(20, 7)"]),
    ({"hidden": torch.randn(6, 20)}, ValueError, ["weight", "(20, 8)", "is the vocab size", "not its logits"]),
    ({"weight": torch.randn(0, 8)}, ValueError, ["weight", "at least one row"]),
    ({"weight": torch.randn(20, 8, dtype=torch.float64)}, TypeError, ["weight", "torch.float32", "float64"]),
    ({"hidden": torch.randn(6, 8, dtype=torch.float64), "backend": "torch"}, TypeError, ["weight", "float64"]),
    ({"hidden": torch.randint(0, 3, (6, 8))}, TypeError, ["hidden", "dtype", "torch.int64"]),
    ({"hidden": torch.randn(())}, ValueError, ["hidden", "[..., D]", "0-d"]),
    ({"target": torch.randint(0, 20, (5,))}, ValueError, ["target", "(6,)", "(5,)"]),
    ({"target": torch.zeros(6)}, TypeError, ["target", "int64", "float32"]),
    ({"target": torch.tensor([0, 1, 2, 3, 4, 20])}, ValueError, ["target", "[0, 20)", "got 20", "(5,)"]),
    ({"target": torch.tensor([0, 1, -1, 3, 4, 5])}, ValueError, ["target", "ignore_index=-100", "got -1"]),
    ({"bias": torch.randn(19)}, ValueError, ["bias", "(20,)", "(19,)"]),
    ({"bias": torch.randn(20, dtype=torch.float64)}, TypeError, ["bias", "torch.float32", "float64"]),
    ({"bias": [0.0]}, TypeError, ["bias", "Tensor", "list"]),
    ({"weight": torch.randn(20, 8, device="meta")}, ValueError, ["weight", "device cpu", "meta"]),
    ({"reduction": "avg"}, ValueError, ["reduction", "'mean'", "'avg'"]),
    ({"label_smoothing": 1.5}, ValueError, ["label_smoothing", "<= 1.0", "1.5"]),
    ({"label_smoothing": -0.1}, ValueError, ["label_smoothing", ">= 0.0", "-0.1"]),
    ({"label_smoothing": "0.1"}, TypeError, ["label_smoothing", "real number", "str"]),
    ({"z_loss": -1e-4}, ValueError, ["z_loss", ">= 0.0", "-0.0001"]),
    ({"z_loss": float("nan")}, ValueError, ["z_loss", "NaN"]),
    ({"softcap": 0.0}, ValueError, ["softcap", "> 0.0", "0.0"]),
    ({"softcap": -30.0}, ValueError, ["softcap", "> 0.0", "-30.0"]),
    ({"vocab_size": 21}, ValueError, ["vocab_size", "at most", "20", "21"]),
    ({"vocab_size": 0}, ValueError, ["vocab_size", ">= 1", "0"]),
    ({"vocab_size": 10.0}, TypeError, ["vocab_size", "int", "float"]),
    ({"vocab_start": 5}, ValueError, ["vocab_start", "not sharded", "5"]),
    ({"vocab_start": -1}, ValueError, ["vocab_start", ">= 0", "-1"]),
    ({"ignore_index": 1.5}, TypeError, ["ignore_index", "int", "float"]),
    ({"sequence_parallel": True}, ValueError, ["sequence_parallel", "group=None"]),
    ({"sequence_parallel": 1}, TypeError, ["sequence_parallel", "bool", "int"]),
    ({"backend": "cuda"}, ValueError, ["backend", "'triton'", "'cuda'"]),
    ({"memory_budget": "small"}, ValueError, ["memory_budget", "'lean'", "'small'"]),
    ({"memory_budget": 0}, ValueError, ["memory_budget", "> 0.0", "0"]),
    ({"validate": "yes"}, TypeError, ["validate", "bool", "str"]),
    ({"group": object()}, ValueError, ["group", "not initialized"]),
]


@pytest.mark.parametrize("over,exc,words", CASES, ids=[f"{i}-{next(iter(c[0]))}" for i, c in enumerate(CASES)])
def test_bad_input_is_named(over, exc, words):
    args = good(**over)
    with pytest.raises(exc) as info:
        vpce.linear_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("target"), **args)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_module_validates_at_construction():
    with pytest.raises(ValueError, match="reduction"):
        vpce.LinearCrossEntropy(reduction="avg")
    with pytest.raises(ValueError, match="softcap"):
        vpce.LinearCrossEntropy(softcap=0)
    with pytest.raises(ValueError, match="backend"):
        vpce.LinearCrossEntropy(backend="cuda")


def test_ignore_index_may_be_any_int_and_targets_must_fit_padded_vocab():
    args = good(target=torch.tensor([0, 7, 7, 3, 18, 5]))
    loss = vpce.linear_cross_entropy(args["hidden"], args["weight"], args["target"], ignore_index=7)
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"target: expected ids in \[0, 15\)"):
        vpce.linear_cross_entropy(args["hidden"], args["weight"], args["target"], vocab_size=15)


@pytest.mark.parametrize("which", ["hidden", "weight", "target"])
def test_meta_tensors_are_named(which):
    """A tensor on the meta device (a model built with device="meta", not materialized) gets a ValueError naming
    the argument and the device, not torch's "unknown device type for autocast"."""
    tensors = dict(hidden=torch.randn(4, 8), weight=torch.randn(16, 8), target=torch.randint(0, 16, (4,)))
    if which == "hidden":  # all on meta: hidden is named
        tensors = {k: t.to("meta") for k, t in tensors.items()}
        match = r"hidden: expected a tensor with data \(cpu, cuda\), got device meta"
    else:  # one on meta beside a cpu hidden: the device check names it
        tensors[which] = tensors[which].to("meta")
        match = rf"{which}: expected device cpu \(hidden's\), got meta"
    for fn in (vpce.linear_cross_entropy, vpce.linear_log_probs):
        with pytest.raises(ValueError, match=match):
            fn(tensors["hidden"], tensors["weight"], tensors["target"])


@pytest.mark.parametrize("memory_budget", ["auto", "lean"])
def test_double_backward_is_refused_by_name(memory_budget):
    """create_graph=True: "double backward is not supported", on either route, for both public losses."""
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    y = torch.randint(0, 16, (4,))
    for loss in (vpce.linear_cross_entropy(h, w, y, memory_budget=memory_budget),
                 vpce.linear_log_probs(h, w, y, memory_budget=memory_budget).sum()):
        with pytest.raises(RuntimeError, match="double backward is not supported"):
            torch.autograd.grad(loss, h, create_graph=True)


def test_triton_interpreter_refuses_bfloat16():
    """The CPU interpreter's numpy emulation has no bfloat16 (its ``tl.dot`` once gave a loss of 9.6e9, silently):
    ``backend="triton"`` on CPU tensors names the dtype instead, under autocast too; ``"auto"`` takes torch."""
    if torch.cuda.is_available():
        pytest.skip("CPU tensors only")
    pytest.importorskip("triton")
    h, w, t = torch.randn(6, 8), torch.randn(20, 8), torch.randint(0, 20, (6,))
    with pytest.raises(TypeError, match=r"hidden: backend='triton' on the CPU interpreter .* got bfloat16"):
        vpce.linear_cross_entropy(h.bfloat16(), w.bfloat16(), t, backend="triton")
    with pytest.raises(TypeError, match="got bfloat16"), torch.autocast("cpu", dtype=torch.bfloat16):
        vpce.linear_log_probs(h, w, t, backend="triton")
    ref = torch.nn.functional.cross_entropy(h.bfloat16().double() @ w.bfloat16().double().t(), t)
    got = vpce.linear_cross_entropy(h.bfloat16(), w.bfloat16(), t, backend="auto")
    assert abs(float(got) - float(ref)) < 1e-2, (float(got), float(ref))
