"""vpce.linear_log_probs: per-token log-probabilities and entropy with exact gradients, against float64."""

import pytest
import torch

import vpce
from distributed import run_ranks
from vpce.reference import reference_log_probs, rel_err
from problems import leaf, make_problem

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BACKENDS = [("torch", torch.float64, 1e-11), ("triton", torch.float32, 3e-5)]


def upstream(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64), torch.randn(shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "logp+entropy"])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.3, 4.0)], ids=["T1", "T0.7", "T1.3-cap4"])
def test_matches_oracle(backend, dtype, tol, entropy, temperature, softcap):
    p = make_problem((3, 13), 24, 150, dtype=dtype, bias=True, vocab_size=141, ignore_frac=0.2, scale=3.0, seed=4)
    gl, ge = upstream(p.target.shape, 1)
    h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
    out = vpce.linear_log_probs(h, w, p.target.to(DEV), b, temperature=temperature, softcap=softcap,
                                return_entropy=entropy, vocab_size=141, backend=backend)
    logp, ent = out if entropy else (out, None)
    total = (logp * gl.to(DEV, logp.dtype)).sum() + ((ent * ge.to(DEV, ent.dtype)).sum() if entropy else 0)
    total.backward()
    r_logp, r_ent, ref = reference_log_probs(p.hidden, p.weight, p.target, p.bias, g_logp=gl,
                                             g_ent=ge if entropy else None, temperature=temperature,
                                             softcap=softcap, vocab_size=141)
    checks = [("logp", logp, r_logp), ("dX", h.grad, ref.dhidden), ("dW", w.grad, ref.dweight),
              ("db", b.grad, ref.dbias)] + ([("entropy", ent, r_ent)] if entropy else [])
    for name, got, want in checks:
        err = rel_err(got, want)
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"
    assert logp.shape == p.target.shape and (logp[p.target.to(DEV) == -100] == 0).all()


def test_only_entropy_used_and_no_grad():
    p = make_problem(20, 16, 60, dtype=torch.float64, seed=2)
    _, ge = upstream(p.target.shape, 2)
    h, w = leaf(p.hidden), leaf(p.weight)
    _, ent = vpce.linear_log_probs(h, w, p.target, return_entropy=True)
    (ent * ge).sum().backward()
    _, _, ref = reference_log_probs(p.hidden, p.weight, p.target, g_ent=ge)
    assert rel_err(h.grad, ref.dhidden) < 1e-11 and rel_err(w.grad, ref.dweight) < 1e-11
    with torch.no_grad():
        lp = vpce.linear_log_probs(p.hidden, p.weight, p.target)
    assert lp.grad_fn is None and rel_err(lp, reference_log_probs(p.hidden, p.weight, p.target, g_logp=ge)[0]) < 1e-12


def test_bad_arguments():
    p = make_problem(5, 8, 20)
    with pytest.raises(ValueError, match="temperature: expected > 0.0"):
        vpce.linear_log_probs(p.hidden, p.weight, p.target, temperature=0.0)
    with pytest.raises(TypeError, match="return_entropy: expected a bool"):
        vpce.linear_log_probs(p.hidden, p.weight, p.target, return_entropy=1)
    with pytest.raises(ValueError, match=r"target: expected ids in \[0, 20\)"):
        vpce.linear_log_probs(p.hidden, p.weight, torch.tensor([0, 1, 2, 3, 25]))


def _tp_main(rank, world, backend):
    import torch.distributed as dist

    sizes = [40, 25, 33][:world]
    dtype = torch.float64 if backend == "torch" else torch.float32
    p = make_problem((3 * world, 2), 16, sum(sizes), dtype=dtype, bias=True, vocab_size=sum(sizes) - 5,
                     ignore_frac=0.2, scale=2.0, seed=6)
    gl, ge = upstream(p.target.shape, 3)
    start = sum(sizes[:rank])
    out = []
    for sp in (False, True):
        h = leaf(p.hidden[rank * 3:(rank + 1) * 3] if sp else p.hidden)
        w, b = leaf(p.weight[start:start + sizes[rank]]), leaf(p.bias[start:start + sizes[rank]])
        logp, ent = vpce.linear_log_probs(h, w, p.target, b, temperature=0.8, softcap=5.0, return_entropy=True,
                                          group=dist.group.WORLD, sequence_parallel=sp, vocab_size=p.vocab_size,
                                          backend=backend)
        ((logp * gl.to(dtype)).sum() + (ent * ge.to(dtype)).sum()).backward()
        r_logp, r_ent, ref = reference_log_probs(p.hidden, p.weight, p.target, p.bias, g_logp=gl, g_ent=ge,
                                                 temperature=0.8, softcap=5.0, vocab_size=p.vocab_size)
        want_dx = ref.dhidden[rank * 3:(rank + 1) * 3] if sp else ref.dhidden
        out.append(max(rel_err(logp, r_logp), rel_err(ent, r_ent), rel_err(h.grad, want_dx),
                       rel_err(w.grad, ref.dweight[start:start + sizes[rank]]),
                       rel_err(b.grad, ref.dbias[start:start + sizes[rank]])))
    return out


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vocab_parallel(backend):
    tol = 1e-11 if backend == "torch" else 3e-5
    for rank, errs in enumerate(run_ranks(_tp_main, 3, backend)):
        assert max(errs) < tol, f"rank {rank}: errs {errs}"
