"""torch.compile(fullgraph=True) around vpce (through the torch.library ops: the cross-entropy's and the
distillation's) gives the eager result; a training step that uses vpce can be captured in a CUDA graph (GPU
only)."""

import pytest
import torch

import vpce
from vpce.reference import rel_err
from problems import leaf, make_problem

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BACKENDS = ["torch", "triton"]


def _loss(h, w, t, b, backend, reduction, budget):
    return vpce.linear_cross_entropy(h, w, t, b, backend=backend, reduction=reduction, memory_budget=budget,
                                     label_smoothing=0.1, z_loss=1e-3)


# the fast route (mean), the lean one with its backward op (mean, none); under torch.compile reduction="none" is
# lean whatever the budget (the speculative route is not taken there), so ("none", "auto") would rerun it
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction,budget", [("mean", "auto"), ("mean", "lean"), ("none", "lean")], ids=lambda x: x)
def test_fullgraph_equals_eager(backend, reduction, budget):
    torch._dynamo.reset()
    p = make_problem(37, 16, 90, dtype=torch.float32, bias=True, ignore_frac=0.2, reduction=reduction, seed=1)
    compiled = torch.compile(_loss, fullgraph=True)
    results = []
    for fn in (_loss, compiled):
        h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
        loss = fn(h, w, p.target.to(DEV), b, backend, reduction, budget)
        (loss * p.grad.to(DEV, loss.dtype)).sum().backward()
        results.append((loss.detach(), h.grad, w.grad, b.grad))
    for name, a, c in zip(("loss", "dX", "dW", "db"), *results):
        assert rel_err(c, a) < 1e-6, f"{name}: compiled differs from eager by {rel_err(c, a):.2e}"


@pytest.mark.parametrize("budget", ["auto", "lean"])
def test_fullgraph_with_class_weight_and_logit_scale(budget):
    """The op carries the class weights and the logit scale (fast route; lean: its backward op too)."""
    torch._dynamo.reset()
    p = make_problem(21, 16, 50, dtype=torch.float32, bias=True, ignore_frac=0.2, seed=2)
    cw = torch.rand(50, generator=torch.Generator().manual_seed(1)).to(DEV)

    def loss_fn(h, w, t, b):
        return vpce.linear_cross_entropy(h, w, t, b, memory_budget=budget, label_smoothing=0.1, logit_scale=1.5,
                                         class_weight=cw)
    results = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
        loss = fn(h, w, p.target.to(DEV), b)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad, b.grad))
    for name, a, c in zip(("loss", "dX", "dW", "db"), *results):
        assert rel_err(c, a) < 1e-6, f"{name}: compiled differs from eager by {rel_err(c, a):.2e}"


def test_compiled_training_step():
    """A tiny model's whole forward (trunk + vpce loss) compiled with fullgraph=True, then backward + SGD."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.GELU()).to(DEV)
    head = torch.nn.Linear(32, 301, bias=False).to(DEV)
    twin_trunk = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.GELU()).to(DEV)
    twin_head = torch.nn.Linear(32, 301, bias=False).to(DEV)
    twin_trunk.load_state_dict(trunk.state_dict())
    twin_head.load_state_dict(head.state_dict())
    x = torch.randn(4, 19, 24, device=DEV)
    y = torch.randint(0, 301, (4, 19), device=DEV)

    def forward(trunk, head, x, y):
        return vpce.linear_cross_entropy(trunk(x), head.weight, y)

    compiled = torch.compile(forward, fullgraph=True)
    for _ in range(3):
        for fn, tr, hd in ((forward, trunk, head), (compiled, twin_trunk, twin_head)):
            tr.zero_grad()
            hd.zero_grad()
            loss = fn(tr, hd, x, y)
            loss.backward()
            with torch.no_grad():
                for prm in [*tr.parameters(), *hd.parameters()]:
                    prm -= 0.5 * prm.grad
    for a, c in zip([*trunk.parameters(), *head.parameters()], [*twin_trunk.parameters(), *twin_head.parameters()]):
        assert rel_err(c, a) < 1e-6


def test_op_registration_passes_opcheck():
    """Schema, fake (meta) implementation and autograd registration agree with the real op."""
    from vpce import library  # noqa: F401 - registers the ops

    p = make_problem(13, 8, 40, dtype=torch.float32, bias=True, ignore_frac=0.2)
    for budget, reduction in (("auto", "mean"), ("lean", "none")):
        args = (leaf(p.hidden), leaf(p.weight), leaf(p.bias), p.target, None, torch.rand(40), "torch", -100,
                reduction, 0.1, 0.0, None, budget, 40, 1.5, [True, True, True])
        torch.library.opcheck(torch.ops.vpce.linear_cross_entropy.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_distillation_fullgraph_equals_eager(backend, reduction):
    """``linear_distillation_loss`` through its ops (fast route for ``mean``, lean with its backward op for
    ``none``) gives the eager result bitwise."""
    from test_distillation import make_pair

    torch._dynamo.reset()
    x = make_pair(17, 8, 12, 29, dtype=torch.float32, bias=True, reduction=reduction, seed=9)
    opts = dict(divergence="jsd", ce_weight=0.2, softcap=3.0) if reduction == "mean" else \
        dict(divergence="reverse_kl", temperature=2.0, token_weight=x.token_weight.float().to(DEV))

    def loss_fn(h, w, b, th, tw, t):
        return vpce.linear_distillation_loss(h, w, th, tw, t, b, reduction=reduction, backend=backend, **opts)
    results = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        h, w, b = (leaf(t.to(DEV)) for t in (x.hidden, x.weight, x.bias))
        loss = fn(h, w, b, x.t_hidden.to(DEV), x.t_weight.to(DEV), x.target.to(DEV))
        (loss * x.grad.to(DEV, loss.dtype)).sum().backward()
        results.append((loss.detach(), h.grad, w.grad, b.grad))
    for name, a, c in zip(("loss", "dX", "dW", "db"), *results):
        assert torch.equal(a, c), f"{name}: compiled differs from eager by {rel_err(c, a):.2e}"


def test_distillation_ops_pass_opcheck():
    from test_distillation import make_pair
    from vpce import library  # noqa: F401 - registers the ops

    x = make_pair(13, 8, 6, 40, dtype=torch.float32, bias=True)
    for budget, reduction in (("auto", "mean"), ("lean", "none")):
        args = (leaf(x.hidden), leaf(x.weight), leaf(x.bias), x.t_hidden, x.t_weight, x.t_bias, x.target, None,
                "torch", "jsd", 0.5, 0.5, 4.0, 0.1, -100, reduction, 3.0, None, budget, 40, [True, True, True])
        torch.library.opcheck(torch.ops.vpce.linear_distillation_loss.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_group_under_compile_is_a_clear_error():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("needs no default process group")
    torch._dynamo.reset()
    p = make_problem(5, 8, 20)
    fn = torch.compile(lambda h, w, t: vpce.linear_cross_entropy(h, w, t, accumulate_main_grad=True),
                       fullgraph=True)
    w = leaf(p.weight)
    w.main_grad = torch.zeros_like(w)
    with pytest.raises(Exception, match="torch.compile supports one process without accumulate_main_grad"):
        fn(leaf(p.hidden), w, p.target)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("budget", ["auto", "lean"])
def test_cuda_graph_captures_a_training_step(budget):
    torch.manual_seed(0)
    n, d, v = 1024, 256, 32000
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(v, d, device="cuda") / d**0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")
    y[::7] = -100
    static_x = x.clone().requires_grad_()

    def step():
        loss = vpce.linear_cross_entropy(static_x, w, y, memory_budget=budget)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up (compiles the kernels) outside the capture
            static_x.grad = w.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = w.grad = None
    eager_loss, eager_dx, eager_dw = step().detach().clone(), static_x.grad.clone(), w.grad.clone()

    static_x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_loss, eager_loss)
    assert torch.equal(static_x.grad, eager_dx) and torch.equal(w.grad, eager_dw)


def _snippet(heading: str) -> str:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


def test_docs_compile_snippet_runs():
    torch._dynamo.reset()
    exec(compile(_snippet("## torch.compile and CUDA graphs"), "docs/integrations.md", "exec"), {})
