"""#36, branch quack-gemms: the chunk loop's fp32-out gradient GEMMs, cuBLAS against quack at sm_90 configs, on the
shapes the bench heads run (one H100). Roles:
  dx      out[c, D] fp32 = g[c, V] @ w[V, D]            (hidden_grad_into)
  dw_new  out[V, D] fp32 = g^T x                        (weight_grad_into, first chunk)
  dw_add  acc[V, D] fp32 += g^T x, in place             (weight_grad_into, later chunks)
  logits  out[c, V] bf16 = x[c, D] @ w[V, D]^T          (logits_into: cuBLAS today)
$OUT/qgemm.json after each entry; ONLY=<substring of the case name> to run a subset."""
import json, os, time, torch
from quack import gemm_interface as q
from quack.gemm_config import GemmConfig

OUT = os.path.join(os.environ.get("OUT", "/tmp"), "qgemm.json")


def t(fn, reps=8):
    for _ in range(2): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


CONFIGS = [  # tile_m, tile_n, cluster_m, cluster_n, pingpong
    (128, 256, 2, 1, False), (256, 192, 1, 2, False), (256, 128, 2, 1, False), (128, 256, 1, 2, False),
    (128, 192, 2, 1, True), (256, 208, 2, 1, False), (192, 256, 1, 2, False),
]
CASES = [  # name, role, c (tokens), V, D
    ("llama-8192-dx", "dx", 8192, 128256, 4096), ("llama-8192-dw_new", "dw_new", 8192, 128256, 4096),
    ("llama-8192-dw_add", "dw_add", 8192, 128256, 4096),
    ("llama-tp2-8192-dx", "dx", 8192, 64128, 4096), ("llama-tp2-8192-dw_new", "dw_new", 8192, 64128, 4096),
    ("llama-tp2-8192-dw_add", "dw_add", 8192, 64128, 4096),
    ("gemma-4096-dx", "dx", 4096, 256000, 2304),
    ("llama-16384-logits", "logits", 16384, 128256, 4096), ("gemma-8192-logits", "logits", 8192, 256000, 2304),
    ("llama-tp2-8192-logits", "logits", 8192, 64128, 4096),
]
out = {"device": torch.cuda.get_device_name(), "configs": CONFIGS}
for name, role, c, V, D in CASES:
    if os.environ.get("ONLY") and os.environ["ONLY"] not in name:
        continue
    torch.manual_seed(0)
    g = (torch.randn(c, V, device="cuda") * 0.01).to(torch.bfloat16) if role != "logits" else torch.empty(0)
    w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) if role == "dx" else None
    x = torch.randn(c, D, device="cuda", dtype=torch.bfloat16) if role != "dx" else None
    r = {}
    out[name] = r
    if role == "logits":
        x = torch.randn(c, D, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02
        del g
        g = None
        o = torch.empty(c, V, device="cuda", dtype=torch.bfloat16)
        r["cublas"] = t(lambda: torch.mm(x, w.t(), out=o))
        ref = torch.mm(x, w.t(), out_dtype=torch.float32)
        run = lambda cfg: q.gemm_tuned.fn(x, w.t(), o, config=cfg)  # noqa: E731
    elif role == "dx":
        o = torch.empty(c, D, device="cuda")
        r["cublas"] = t(lambda: torch.addmm(o, g, w, beta=0, out_dtype=torch.float32, out=o))
        ref = torch.mm(g, w, out_dtype=torch.float32)
        run = lambda cfg: q.gemm_tuned.fn(g, w, o, config=cfg)  # noqa: E731
    else:
        o = torch.empty(V, D, device="cuda")
        base = torch.mm(g.t(), x, out_dtype=torch.float32)
        if role == "dw_new":
            r["cublas"] = t(lambda: torch.mm(g.t(), x, out_dtype=torch.float32, out=o))
            ref = base
            run = lambda cfg: q.gemm_tuned.fn(g.t(), x, o, config=cfg)  # noqa: E731
        else:
            r["cublas"] = t(lambda: torch.addmm(o, g.t(), x, out_dtype=torch.float32, out=o))
            ref = 2 * base  # o = base, then += base once (checked after one call from o = base)
            run = lambda cfg: q.gemm_tuned.fn(g.t(), x, o, None, add_to_output=True, config=cfg)  # noqa: E731
    print(name, "cublas", round(r["cublas"], 3), flush=True)
    for cfg_t in CONFIGS:
        label = "%dx%d c%dx%d %s" % (cfg_t[0], cfg_t[1], cfg_t[2], cfg_t[3], "pp" if cfg_t[4] else "coop")
        try:
            cfg = GemmConfig(tile_m=cfg_t[0], tile_n=cfg_t[1], cluster_m=cfg_t[2], cluster_n=cfg_t[3],
                             pingpong=cfg_t[4], is_dynamic_persistent=False)
            if role == "dw_add":
                o.copy_(base)
            t0 = time.perf_counter(); run(cfg); torch.cuda.synchronize()
            err = ((o.float() - ref).abs().max() / ref.abs().max()).item()
            r[label] = {"ms": t(lambda: run(cfg)), "compile_s": round(time.perf_counter() - t0, 2), "err": err}
        except Exception as e:  # noqa: BLE001
            r[label] = "failed: " + repr(e)[:200]
        print(name, label, r[label], flush=True)
        json.dump(out, open(OUT, "w"), indent=1)
    del g, w, x, o
    torch.cuda.empty_cache()
