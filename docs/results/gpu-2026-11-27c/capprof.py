"""Where the soft cap's cost goes in the two bandwidth passes (stored_logits stats and grad modes) on a Llama-3-8B
chunk (8192 x 128256 bf16): plain, the cap as today, the cap with its reciprocal by Newton steps on the FMA pipe
(no MUFU rcp), the cap replaced by the identity (the SOFTCAP path's other work only), and today's cap at other
launch shapes. Prints ms per pass and writes $OUT/capprof.json."""
import json, math, os, torch, triton, triton.language as tl
from vpce import kernels
from vpce.kernels import softmax as sm
from vpce.kernels.common import _exp

OUT = os.path.join(os.environ.get("OUT", "/tmp"), "capprof.json")


@triton.jit
def _cap_newton(x, softcap):
    u = x * (1.0 / softcap)
    e = _exp(-2.0 * tl.abs(u))
    y = 1.0 + e                      # in [1, 2]
    r = 1.4117647058823528 - 0.47058823529411764 * y  # 24/17 - 8/17 y: within 1/17 of 1/y
    r = r + r * (1.0 - y * r)
    r = r + r * (1.0 - y * r)
    r = r + r * (1.0 - y * r)
    th = (1.0 - e) * r
    return softcap * tl.where(u >= 0, th, -th), 4.0 * e * (r * r)


@triton.jit
def _cap_identity(x, softcap):
    return x, x * 0.0 + 1.0


def t(fn, reps=20):
    for _ in range(3): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


M, V = 8192, 128256
torch.manual_seed(0)
P0 = (torch.randn(M, V, device="cuda") * 3).to(torch.bfloat16)
P = P0.clone()
tl_local = torch.randint(0, V, (M,), device="cuda", dtype=torch.int32)
nt = triton.cdiv(V, kernels.tile_n(P))
f32 = dict(device="cuda", dtype=torch.float32)
tm, ts = torch.empty(M, nt, **f32), torch.empty(M, nt, **f32)
rows = (torch.zeros(M, **f32), torch.full((M,), 15.0, **f32), torch.full((M,), 0.5, **f32))
coef = (torch.full((M,), 1e-4, **f32), None, torch.full((M,), -1e-4, **f32), None)
out = {"device": torch.cuda.get_device_name()}
real = sm._softcap


def case(name, cap, impl=None, **launch):
    sm._softcap = impl or real
    try:
        st = t(lambda: kernels.stored_logits(P0, None, tl_local, softcap=cap, tile_m=tm, tile_s=ts, **launch))
        gr = t(lambda: kernels.stored_logits(P, None, tl_local, softcap=cap, rows=rows, coef=coef, **launch))
        out[name] = {"stats_ms": round(st, 4), "grad_ms": round(gr, 4)}
    except Exception as e:  # noqa: BLE001
        out[name] = "failed: " + repr(e)[:300]
    finally:
        sm._softcap = real
    print(name, out[name], flush=True)
    json.dump(out, open(OUT, "w"), indent=1)


case("plain", None)
case("cap today", 30.0)
case("cap newton rcp", 30.0, _cap_newton)
case("cap identity", 30.0, _cap_identity)
case("plain again", None)
for bm, nw in ((16, 8), (32, 4), (32, 8), (8, 4)):
    case(f"cap today bm{bm} w{nw}", 30.0, block_m=bm, num_warps=nw)
    case(f"plain bm{bm} w{nw}", None, block_m=bm, num_warps=nw)
case("cap today again", 30.0)
