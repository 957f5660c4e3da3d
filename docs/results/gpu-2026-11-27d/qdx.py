"""#36 items 2+3: dX of one whole chunk, scaled by a device scalar and written in bf16, on the
Llama-3-8B (C=16384) and Gemma-2-2B (C=8192) heads: cuBLAS fp32 mm + scale_cast, cuBLAS bf16 mm of the pre-scaled
hidden, and quack's gemm (alpha on the device) over explicit sm90 configs. $OUT/qdx.json after each entry."""
import json, os, sys, time, torch
from vpce import kernels
from quack import gemm_interface as q
from quack.gemm_config import GemmConfig

OUT = os.path.join(os.environ.get("OUT", "/tmp"), "qdx.json")


def t(fn, reps=10):
    for _ in range(2): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


CONFIGS = [  # tile_m, tile_n, cluster_m, cluster_n, pingpong, swap_ab
    (256, 192, 1, 2, False, False), (256, 128, 2, 1, False, False), (128, 256, 2, 1, False, False),
    (128, 192, 2, 1, True, False), (256, 208, 2, 1, False, False), (128, 256, 1, 2, False, False),
]
out = {"device": torch.cuda.get_device_name()}
for name, V, D, C in (("llama", 128256, 4096, 16384), ("gemma", 256000, 2304, 8192)):
    if os.environ.get("ONLY") and name != os.environ["ONLY"]:
        continue
    torch.manual_seed(0)
    g = (torch.randn(C, V, device="cuda") * 0.01).to(torch.bfloat16)
    s = torch.full((1,), 0.37, device="cuda")
    r = {}
    out[name] = r
    w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16)
    x = w  # the GEMM below: dX = s * (g @ w), [C, D] over K = V
    acc = torch.mm(g, w, out_dtype=torch.float32)
    r["cublas_mm_f32_ms"] = t(lambda: torch.mm(g, w, out_dtype=torch.float32, out=acc))
    r["cublas_bf16_ms"] = t(lambda: torch.mm(g, w))
    r["scale_cast_ms"] = t(lambda: kernels.scale_cast(acc, s[0], torch.bfloat16))
    ref = (acc.double() * 0.37).float()  # fp32 accumulation: the reference for the rounding only
    del acc
    ref_max = ref.abs().max()
    dref = kernels.scale_cast(torch.mm(g, w, out_dtype=torch.float32), s[0], torch.bfloat16)
    r["cublas_cast_err"] = ((dref.float() - ref).abs().max() / ref_max).item()
    xg = None
    d = torch.empty(C, D, device="cuda", dtype=torch.bfloat16)
    for cfg_t in CONFIGS:
        label = "heuristic(None)" if cfg_t is None else "%dx%d c%dx%d %s%s" % (
            cfg_t[0], cfg_t[1], cfg_t[2], cfg_t[3], "pp" if cfg_t[4] else "coop", " swap" if cfg_t[5] else "")
        try:
            cfg = None if cfg_t is None else GemmConfig(tile_m=cfg_t[0], tile_n=cfg_t[1], cluster_m=cfg_t[2],
                                                        cluster_n=cfg_t[3], pingpong=cfg_t[4], swap_ab=cfg_t[5],
                                                        is_dynamic_persistent=False)
            run = lambda: q.gemm_tuned.fn(g, w, d, alpha=s, config=cfg)  # noqa: E731
            t0 = time.perf_counter(); run(); torch.cuda.synchronize()
            r[label] = {"ms": t(run), "compile_s": round(time.perf_counter() - t0, 2),
                        "err": ((d.float() - ref).abs().max() / ref_max).item(),
                        "same_bits_as_cublas_cast": bool(torch.equal(d, dref))}
        except Exception as e:  # noqa: BLE001
            r[label] = "failed: " + repr(e)[:200]
        print(name, label, r[label], flush=True)
        json.dump(out, open(OUT, "w"), indent=1)
    del g, w, x, ref, d, dref
    torch.cuda.empty_cache()
