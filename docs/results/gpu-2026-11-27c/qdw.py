"""#36 item 2: the last chunk's dW finish on the Llama-3-8B and Gemma-2-2B heads (one H100/H200): cuBLAS fp32 addmm +
vpce's scale_cast pass, against quack's gemm_add (C fp32 -> D bf16, alpha = beta = g) with its default config, a few
explicit configs, and autotuned (the chosen config and the best timings recorded). Writes $OUT/qdw.json after each
shape (never only through a pipe)."""
import json, os, time, torch
from vpce import kernels
from quack import gemm_interface as q
from quack.gemm_config import GemmConfig

OUT = os.path.join(os.environ.get("OUT", "/tmp"), "qdw.json")


def t(fn, reps=10):
    for _ in range(2): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


CONFIGS = {  # (tile_m, tile_n, cluster_m, cluster_n, pingpong)
    "128x192 c2x1 pp (sm90 default)": (128, 192, 2, 1, True),
    "128x256 c2x1 pp": (128, 256, 2, 1, True),
    "128x256 c1x2 pp": (128, 256, 1, 2, True),
    "256x128 c2x1 coop": (256, 128, 2, 1, False),
    "256x192 c1x1 coop": (256, 192, 1, 1, False),
    "256x256 c2x1 coop": (256, 256, 2, 1, False),
}
out = {"device": torch.cuda.get_device_name()}
for name, V, D, C in (("llama", 128256, 4096, 8192), ("gemma", 256000, 2304, 4096)):
    acc = torch.randn(V, D, device="cuda")
    g = torch.randn(C, V, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(C, D, device="cuda", dtype=torch.bfloat16)
    s = torch.full((1,), 0.5, device="cuda")
    d = torch.empty(V, D, device="cuda", dtype=torch.bfloat16)
    r = {"cublas_addmm_ms": t(lambda: torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)),
         "scale_cast_ms": t(lambda: kernels.scale_cast(acc, s[0], torch.bfloat16))}
    ref = ((acc.double() + g.t().double() @ x.double()) * 0.5).float()
    err = lambda: ((d.float() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    for label, (tm, tn, cm, cn, pp) in CONFIGS.items():
        cfg = GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=pp, is_dynamic_persistent=False)
        try:
            run = lambda: q.gemm_tuned.fn(g.t(), x, d, C=acc, alpha=s, beta=s, config=cfg)  # noqa: E731
            t0 = time.perf_counter(); run(); torch.cuda.synchronize()
            r[label] = {"ms": t(run), "compile_s": time.perf_counter() - t0, "max_rel_err": err()}
        except Exception as e:  # noqa: BLE001
            r[label] = "failed: " + repr(e)[:300]
        print(name, label, r[label], flush=True)
        json.dump({**out, name: r}, open(OUT, "w"), indent=1)
    t0 = time.perf_counter()
    q.gemm_add(g.t(), x, acc, out=d, alpha=s, beta=s, tuned=True)
    torch.cuda.synchronize()
    r["tuned"] = {"first_s": time.perf_counter() - t0, "best": repr(q.gemm_tuned.best_config),
                  "ms": t(lambda: q.gemm_add(g.t(), x, acc, out=d, alpha=s, beta=s, tuned=True)), "max_rel_err": err()}
    timings = getattr(q.gemm_tuned, "configs_timings", None) or {}
    r["tuned"]["top"] = [[repr(k), v] for k, v in sorted(timings.items(), key=lambda kv: kv[1])[:6]]
    print(name, "tuned", r["tuned"], flush=True)
    out[name] = r
    json.dump(out, open(OUT, "w"), indent=1)
    del acc, g, x, ref, d
