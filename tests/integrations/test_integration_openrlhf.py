"""``vpce.integrations.openrlhf`` against OpenRLHF 0.11.2's own ``openrlhf/models/loss.py`` (``PolicyLoss``,
``DPOLoss``) and its actor's per-token definitions (``log_probs_from_logits``, ``compute_entropy`` of
``openrlhf/models/utils.py``), on float64 materialized logits; both backends, and 2 gloo ranks with the vocab split.

OpenRLHF's package ``__init__`` imports flash-attn (and ``models/utils.py`` DeepSpeed), neither of which installs
usefully on a CPU machine; the two files are loaded from the installed package as they are, with
``models/utils.py``'s ``import deepspeed`` line left out (it serves only ``set_z3_leaf_modules``).
"""

import importlib.util
import pathlib
import sys
import types

import pytest
import torch
import torch.distributed as dist

import vpce.integrations.openrlhf as vrlhf
from distributed import run_ranks
from test_post_training import CUDA, DEV, B, T, V, check, leaves, materialized, problem

BACKENDS = [("torch", torch.float64, 1e-10, 1e-10), ("triton", torch.float32, 2e-5, 5e-5)]


def openrlhf_models():
    """OpenRLHF's ``models/loss.py`` and ``models/utils.py`` (without the package's GPU-only imports)."""
    if "openrlhf.models.loss" in sys.modules and hasattr(sys.modules["openrlhf.models.loss"], "PolicyLoss"):
        return sys.modules["openrlhf.models.loss"], sys.modules["openrlhf.models.utils"]
    spec = importlib.util.find_spec("openrlhf")
    if spec is None:
        pytest.skip("openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")
    root = pathlib.Path(spec.submodule_search_locations[0]) / "models"
    for name in ("openrlhf", "openrlhf.models"):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root.parent if name == "openrlhf" else root)]
            sys.modules[name] = pkg
    utils = types.ModuleType("openrlhf.models.utils")
    source = (root / "utils.py").read_text().replace("import deepspeed\n", "")
    exec(compile(source, str(root / "utils.py"), "exec"), utils.__dict__)
    sys.modules["openrlhf.models.utils"] = utils
    loss_spec = importlib.util.spec_from_file_location("openrlhf.models.loss", root / "loss.py")
    loss = importlib.util.module_from_spec(loss_spec)
    sys.modules["openrlhf.models.loss"] = loss
    loss_spec.loader.exec_module(loss)
    return loss, utils


def data(seed=3):
    h, w, bias, y, gen = problem(seed=seed)
    logp, _ = materialized(h, w, bias, y)
    old = logp + (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 0.8
    rollout = old + (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 1.2
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    return h, w, bias, y, old, rollout, adv


CASES = {  # id: PolicyLoss keywords, and the aggregation constants given
    "ppo-token": (dict(), {}),
    "ppo-dual-clip-global-tokens": (dict(dual_clip=3.0, clip_eps_high=0.28), dict(batch_num_tokens=90.0)),
    "ppo-sequence-mean": (dict(token_level_loss=False), {}),
    "ppo-tis-token-clip": (dict(is_correction_level="token", is_correction_mode="clip",
                                is_correction_threshold=(0.8, 1.2)), {}),
    "ppo-seq-mask-tv": (dict(is_correction_level="seq", is_correction_gating="tv",
                             is_correction_threshold=(0.0, 0.05)), {}),
    "gspo-rollout": (dict(policy_loss_type="gspo", is_correction_level="token"), {}),
}


@pytest.mark.parametrize("backend,dtype,tol,gtol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("case", list(CASES))
def test_policy_loss_matches_openrlhf(backend, dtype, tol, gtol, case):
    if backend == "triton" and case not in ("ppo-dual-clip-global-tokens", "gspo-rollout"):
        pytest.skip("the interpreter is slow: a subset on Triton")
    loss_mod, _ = openrlhf_models()
    kw, consts = CASES[case]
    module = loss_mod.PolicyLoss(**kw)
    h, w, bias, y, old, rollout, adv = data()
    mask = y != -100
    hr, wr, br = (x.clone().requires_grad_() for x in (h, w, bias))
    logp, _ = materialized(hr, wr, br, y)
    want = module(logp, old, adv, action_mask=mask, rollout_log_probs=rollout, **consts)
    want[0].backward()
    hx, wx, bx = leaves(dtype, h, w, bias)
    to = lambda x: x.to(DEV, dtype)  # noqa: E731
    got = vrlhf.policy_loss(module, hx, wx, y.to(DEV), to(old), to(adv), bx, rollout_log_probs=to(rollout),
                            backend=backend, memory_budget=1e-6 if backend == "triton" else "auto", **consts)
    got[0].backward()
    check("loss", got[0], want[0], tol)
    for i, name in enumerate(("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), 1):
        assert (got[i] is None) == (want[i] is None), name
        if want[i] is not None:
            check(name, got[i], want[i], tol)
    for name, x, r in (("dX", hx, hr), ("dW", wx, wr), ("db", bx, br)):
        check(name, x.grad, r.grad, gtol)


@pytest.mark.parametrize("backend,dtype,tol,gtol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("kw", [dict(beta=0.1), dict(beta=0.1, label_smoothing=0.2), dict(beta=0.5, ipo=True)],
                         ids=["dpo", "cdpo", "ipo"])
def test_dpo_loss_matches_openrlhf(backend, dtype, tol, gtol, kw):
    loss_mod, _ = openrlhf_models()
    module = loss_mod.DPOLoss(**kw)
    h, w, bias, y, gen = problem(seed=5)
    ref_c = torch.randn(B // 2, generator=gen, dtype=torch.float64) - 30
    ref_r = torch.randn(B // 2, generator=gen, dtype=torch.float64) - 30
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    seq = materialized(hr, wr, bias, y)[0].sum(-1)
    want = module(seq[:B // 2], seq[B // 2:], ref_c, ref_r)
    want[0].backward()
    hx, wx, bx = leaves(dtype, h, w, bias)
    got = vrlhf.dpo_loss(module, hx, wx, y.to(DEV), ref_c.to(DEV, dtype), ref_r.to(DEV, dtype), bx.detach(),
                         backend=backend, memory_budget=1e-6 if backend == "triton" else "auto")
    got[0].backward()
    check("loss", got[0], want[0], tol)
    check("chosen_rewards", got[1], want[1], tol)
    check("rejected_rewards", got[2], want[2], tol)
    check("dX", hx.grad, hr.grad, gtol)
    check("dW", wx.grad, wr.grad, gtol)


def test_actor_log_probs_and_entropy_match_openrlhf():
    _, utils = openrlhf_models()
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(V, 16, generator=gen, dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (2, 9), generator=gen)
    logits = h @ w.T
    want_lp = utils.log_probs_from_logits(logits.clone(), ids, temperature=0.8)
    want_ent = utils.compute_entropy(logits / 0.8)
    lp, ent = vrlhf.log_probs(h, w, ids, temperature=0.8, return_entropy=True, backend="torch")
    check("log_probs", lp, want_lp, 1e-10)
    check("entropy", ent, want_ent, 1e-10)


def _ranks(rank, world):
    loss_mod, _ = openrlhf_models()
    rows = V // world + (V % world > 0)
    s = rank * rows
    h, w, bias, y, old, rollout, adv = data()
    hx, wx = h.clone().requires_grad_(), w[s:s + rows].clone().requires_grad_()
    module = loss_mod.PolicyLoss(dual_clip=3.0, is_correction_level="token")
    out = vrlhf.policy_loss(module, hx, wx, y, old, adv, bias[s:s + rows], rollout_log_probs=rollout,
                            group=dist.group.WORLD, backend="torch")
    out[0].backward()
    return [x.detach().numpy() for x in (out[0], hx.grad, wx.grad)]


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
def test_policy_loss_vocab_parallel():
    loss_mod, _ = openrlhf_models()
    results = run_ranks(_ranks, 2, timeout=240)
    h, w, bias, y, old, rollout, adv = data()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, _ = materialized(hr, wr, bias, y)
    want = loss_mod.PolicyLoss(dual_clip=3.0, is_correction_level="token")(logp, old, adv, action_mask=y != -100,
                                                                             rollout_log_probs=rollout)
    want[0].backward()
    rows = V // 2 + (V % 2 > 0)
    for rank, res in enumerate(results):
        got = [torch.from_numpy(x) for x in res]
        check(f"rank {rank} loss", got[0], want[0], 1e-10)
        check(f"rank {rank} dX", got[1], hr.grad, 1e-10)
        check(f"rank {rank} dW", got[2], wr.grad[rank * rows:(rank + 1) * rows], 1e-10)
