"""Prepared in the twelfth session, not yet run (no device time left): what do quack 0.6.5's A-operand transforms
cost? They are a register-sourced mainloop that scales each A element as it is loaded
(``quack.operand_transform.a_transform``, ``transform_a_operand``). Such a transform would let the backward GEMMs
read a ``P`` of scaled exponentials, ``E = 2^(z log2 e - k)`` with ``k`` per (row, 64-column block), and form the
gradient as they load it. That removes vpce's gradient pass: 1.47 ms a step at tp=2 on the Llama-3-8B head, two
bytes read and two written per logit. One GPU; a tp=2 chunk (8192 x 64128) and the whole rank (16384 x 64128),
D = 4096.

    python tr.py

Per shape, the median ms of:
- dX: cuBLAS ``E @ W`` (fp32 out, as vpce's tp=2 dX); quack's plain GEMM (vpce's ``DX_TILE``); quack's GEMM with A
  scaled per (row, 64-column block) (``colvec_ktile``) and a per-row scale in the epilogue, fp32 and bf16 out;
- dW: quack's plain ``E^T @ X`` (bf16 out, vpce's ``DW_TILE``); the same with A scaled per (64-row vocab block,
  token) (``kvec_m64``), fp32 out;
- vpce's gradient pass over the same ``E`` (the pass the transforms would replace).
Each is checked against the same product in float32 from the scaled ``E``. A failure is printed, and the probe
goes on.
"""
import statistics
import traceback

import torch

from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.library import identity_epi
from quack.operand_transform import a_transform
from quack.operand_transform.host import transform_a_operand

from vpce import kernels
from vpce.gemm import DW_TILE, DX_TILE, _config, _quack


@a_transform(vec_size=8, args={"u": "colvec_ktile"})
def scale_row_blocks(x, u):
    return x * u


@a_transform(vec_size=8, args={"u": "kvec_m64"})
def scale_vocab_blocks(x, u):
    return x * u


@gemm_epilogue()
def row_scale(acc, v):
    return {"D": acc * v}


def med(fn, reps=10):
    out = []
    for _ in range(reps + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(2000000)  # the host's launch time hidden
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out[2:])


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def row(name, fn, check=None):
    try:
        got = fn()
        torch.cuda.synchronize()
        err = "" if check is None else f", rel err {rel(got, check):.2e}"
        print(f"  {name:34s} {med(fn):7.3f} ms{err}", flush=True)
    except Exception as e:  # noqa: BLE001 - a probe: report and go on
        print(f"  {name:34s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        traceback.print_exc()


dev = torch.device("cuda")
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
d, v = 4096, 64128
gen = torch.Generator(device=dev).manual_seed(0)
W = (torch.randn(v, d, device=dev, generator=gen) / d ** 0.5).to(torch.bfloat16)
q = _quack()
for n in (8192, 16384):
    print(f"== E [{n}, {v}], D {d}", flush=True)
    E = torch.rand(n, v, device=dev, generator=gen).to(torch.bfloat16)
    X = torch.randn(n, d, device=dev, generator=gen).to(torch.bfloat16)
    # per (64-column block, row): powers of two, exact in bf16; per row: an fp32 scale
    strip = torch.exp2(-torch.randint(0, 4, (v // 64, n), device=dev, generator=gen).float()).to(torch.bfloat16)
    vrow = torch.rand(n, device=dev, generator=gen) + 0.5
    scaled = (E.float().view(n, v // 64, 64) * strip.t().float()[:, :, None]).view(n, v)
    want_dx = (scaled * vrow[:, None]) @ W.float()
    want_dw = scaled.t() @ X.float()
    dx32 = torch.empty(n, d, device=dev)
    dx16 = torch.empty(n, d, device=dev, dtype=torch.bfloat16)
    dw16 = torch.empty(v, d, device=dev, dtype=torch.bfloat16)
    dw32 = torch.empty(v, d, device=dev)
    row("dX cuBLAS fp32 (plain)", lambda: torch.mm(E, W, out_dtype=torch.float32))
    row("dX quack fp32 (plain)", lambda: (q.gemm_tuned.fn(E, W, dx32, config=_config(DX_TILE)), dx32)[1])

    def dx_t(out):
        bundle = transform_a_operand(scale_row_blocks, E, {"u": strip}, 128, 64)
        row_scale.gemm(bundle, W.mT, out, epi_args=dict(v=vrow.unsqueeze(0)), transform_a=scale_row_blocks,
                       tile_M=128, tile_N=256, tile_K=64, cluster_M=2, cluster_N=1)
        return out
    row("dX quack, A transform, fp32", lambda: dx_t(dx32), want_dx)
    row("dX quack, A transform, bf16", lambda: dx_t(dx16), want_dx)
    row("dW quack bf16 (plain)", lambda: (q.gemm_tuned.fn(E.t(), X, dw16, config=_config(DW_TILE)), dw16)[1])

    def dw_t():
        bundle = transform_a_operand(scale_vocab_blocks, E.t(), {"u": strip}, 128, 64)
        identity_epi.gemm(bundle, X.mT, dw32, epi_args={}, transform_a=scale_vocab_blocks, tile_M=128,
                          tile_N=256, tile_K=64, cluster_M=1, cluster_N=2)
        return dw32
    row("dW quack, A transform, fp32", dw_t, want_dw)
    t = torch.randint(0, v, (n,), device=dev, generator=gen).to(torch.int32)
    ones, zeros = torch.ones(n, device=dev), torch.zeros(n, device=dev)
    P = E.clone()

    def grad_pass():
        kernels.stored_logits(P, None, t, rows=(zeros, zeros + 12.0, ones), coef=(ones / n, None, ones / n, None))
        return P
    row("vpce gradient pass (in place)", grad_pass)
    del E, X, P, scaled, want_dx, want_dw, dx32, dx16, dw16, dw32
    torch.cuda.empty_cache()
