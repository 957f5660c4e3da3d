"""#36 item 2, several chunks: the last chunk's dW with the fp32 accumulator as C (gemm_add: scale * (C + g^T x),
bf16 out) at the pinned config and two others, against cuBLAS addmm + scale_cast; Llama-3-8B chunk 8192, Gemma-2-2B
chunk 4096. $OUT/qadd.json."""
import json, os, time, torch
from vpce import kernels
from quack import gemm_interface as q
from quack.gemm_config import GemmConfig

OUT = os.path.join(os.environ.get("OUT", "/tmp"), "qadd.json")


def t(fn, reps=10):
    for _ in range(2): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


CONFIGS = [(256, 192, 1, 2, False), (256, 128, 1, 2, False), (128, 256, 2, 1, False), (128, 192, 2, 1, True)]
out = {"device": torch.cuda.get_device_name()}
for name, V, D, C in (("llama", 128256, 4096, 8192), ("gemma", 256000, 2304, 4096)):
    acc = torch.randn(V, D, device="cuda")
    g = (torch.randn(C, V, device="cuda") * 0.01).to(torch.bfloat16)
    x = torch.randn(C, D, device="cuda", dtype=torch.bfloat16)
    s = torch.full((1,), 0.37, device="cuda")
    d = torch.empty(V, D, device="cuda", dtype=torch.bfloat16)
    r = {"cublas_addmm_ms": t(lambda: torch.addmm(acc, g.t(), x, out_dtype=torch.float32)),
         "scale_cast_ms": t(lambda: kernels.scale_cast(acc, s[0], torch.bfloat16))}
    want = kernels.scale_cast(torch.addmm(acc, g.t(), x, out_dtype=torch.float32), s[0], torch.bfloat16)
    for tm, tn, cm, cn, pp in CONFIGS:
        label = "%dx%d c%dx%d %s" % (tm, tn, cm, cn, "pp" if pp else "coop")
        cfg = GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=pp, is_dynamic_persistent=False)
        try:
            run = lambda: q.gemm_tuned.fn(g.t(), x, d, C=acc, alpha=s, beta=s, config=cfg)  # noqa: E731
            run(); torch.cuda.synchronize()
            r[label] = {"ms": t(run), "same_bits_as_cublas_cast": bool(torch.equal(d, want)),
                        "max_diff": (d.float() - want.float()).abs().max().item()}
        except Exception as e:  # noqa: BLE001
            r[label] = "failed: " + repr(e)[:200]
        print(name, label, r[label], flush=True)
    print(name, "cublas", r["cublas_addmm_ms"], r["scale_cast_ms"], flush=True)
    out[name] = r
    json.dump(out, open(OUT, "w"), indent=1)
    del acc, g, x, d, want
    torch.cuda.empty_cache()
