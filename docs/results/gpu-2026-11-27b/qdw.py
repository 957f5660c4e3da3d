"""#36 item 2: the last chunk's dW finish on the Llama-3-8B and Gemma-2-2B heads (one H100): cuBLAS fp32 addmm +
vpce's scale_cast pass, against quack's gemm_add (C fp32 -> D bf16, alpha = beta = g) untuned (default config),
autotuned, and the autotuned config printed."""
import json, os, time, torch
from vpce import kernels
from quack import gemm_interface as q


def t(fn, reps=10):
    for _ in range(2): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


out = {"device": torch.cuda.get_device_name()}
for name, V, D, C in (("llama", 128256, 4096, 8192), ("gemma", 256000, 2304, 4096)):
    acc = torch.randn(V, D, device="cuda")
    g = torch.randn(C, V, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(C, D, device="cuda", dtype=torch.bfloat16)
    s = torch.full((1,), 0.5, device="cuda")
    r = {}
    r["cublas_addmm_ms"] = t(lambda: torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc))
    r["scale_cast_ms"] = t(lambda: kernels.scale_cast(acc, s[0], torch.bfloat16))
    ref = (acc.double() + g.t().double() @ x.double()) * 0.5
    for tuned in (False, True):
        t0 = time.perf_counter()
        d = q.gemm_add(g.t(), x, acc, alpha=s, beta=s, out_dtype=torch.bfloat16, tuned=tuned)
        torch.cuda.synchronize()
        r[f"quack_tuned{tuned}_first_s"] = time.perf_counter() - t0
        r[f"quack_tuned{tuned}_ms"] = t(lambda: q.gemm_add(g.t(), x, acc, alpha=s, beta=s, out_dtype=torch.bfloat16, tuned=tuned))
        r[f"quack_tuned{tuned}_maxrel"] = ((d.double() - ref).abs().max() / ref.abs().max()).item()
    try:
        cfg = q.gemm_tuned(g.t(), x, torch.empty(V, D, device="cuda", dtype=torch.bfloat16), C=acc, alpha=s, beta=s)
        r["tuned_config"] = repr(cfg[0])
    except Exception as e:  # noqa
        r["tuned_config"] = "n/a: " + repr(e)[:300]
    out[name] = r
    print(name, json.dumps(r, indent=1), flush=True)
    del acc, g, x, ref
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/qdw.json", "w"), indent=1)
