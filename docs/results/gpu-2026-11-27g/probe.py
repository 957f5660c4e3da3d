"""#36: dX and dW of one whole chunk (scaled by a device scalar, written in bf16) over quack's sm_90 configs
(no swap), on one head (ONLY=llama|gemma); cuBLAS fp32 + bf16 beside them. $OUT/probe-<head>.json."""
import json, os, time, torch
from quack import gemm_interface as q
from quack.gemm_config import GemmConfig

HEAD = os.environ["ONLY"]
OUT = os.path.join(os.environ.get("OUT", "/tmp"), f"probe-{HEAD}.json")


def t(fn, reps=10):
    for _ in range(2): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


COOP = [(256, n) for n in (128, 160, 192, 208)] + [(128, 224), (128, 256)]
PP = [(128, 192), (128, 256)]
CONFIGS = [(m, n, cm, cn, False) for m, n in COOP for cm, cn in ((1, 2), (2, 1))]
CONFIGS += [(m, n, cm, cn, True) for m, n in PP for cm, cn in ((1, 2), (2, 1))]
V, D, C = {"llama": (128256, 4096, 16384), "gemma": (256000, 2304, 8192)}[HEAD]
torch.manual_seed(0)
g = (torch.randn(C, V, device="cuda") * 0.01).to(torch.bfloat16)
w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16)
x = torch.randn(C, D, device="cuda", dtype=torch.bfloat16)
s = torch.full((1,), 0.37, device="cuda")
out = {"device": torch.cuda.get_device_name(), "head": HEAD}
for what, a, b, shape in (("dx", g, w, (C, D)), ("dw", g.t(), x, (V, D))):
    r = out[what] = {}
    r["cublas_f32"] = t(lambda: torch.mm(a, b, out_dtype=torch.float32))
    r["cublas_bf16"] = t(lambda: torch.mm(a, b))
    d = torch.empty(*shape, device="cuda", dtype=torch.bfloat16)
    for rnd in (0, 1):  # twice, the second in reverse order: the clock drifts over a run
        for c in (CONFIGS if rnd == 0 else CONFIGS[::-1]):
            label = "%dx%d c%dx%d %s" % (c[0], c[1], c[2], c[3], "pp" if c[4] else "coop")
            try:
                cfg = GemmConfig(tile_m=c[0], tile_n=c[1], cluster_m=c[2], cluster_n=c[3], pingpong=c[4],
                                 swap_ab=False, is_dynamic_persistent=False)
                ms = t(lambda: q.gemm_tuned.fn(a, b, d, alpha=s, config=cfg))
                r[label] = min(ms, r.get(label, 1e9)) if isinstance(r.get(label, 0.0), float) else ms
            except Exception as e:  # noqa: BLE001
                r[label] = "failed: " + repr(e)[:160]
        json.dump(out, open(OUT, "w"), indent=1)
    best = sorted((v, k) for k, v in r.items() if isinstance(v, float) and not k.startswith("cublas"))[:4]
    print(HEAD, what, "cublas f32 %.2f bf16 %.2f" % (r["cublas_f32"], r["cublas_bf16"]), best, flush=True)
    del d
