"""What the fast route's dW costs beyond its GEMMs on the Llama-3-8B head (V=128256, D=4096, bf16): per chunk of
C tokens, the fp32-out accumulate GEMM against a bf16-out GEMM, and the backward's scale+cast pass."""
import json, os, torch
from vpce import kernels

def t(fn, reps=20):
    for _ in range(3): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps

V, D = 128256, 4096
dev = "cuda"
acc = torch.randn(V, D, device=dev)
s = torch.tensor(0.5, device=dev)
out = {"device": torch.cuda.get_device_name(), "scale_cast_ms": t(lambda: kernels.scale_cast(acc, s, torch.bfloat16)),
       "mul_inplace_ms": t(lambda: acc.mul_(s)), "copy_bf16_ms": t(lambda: acc.to(torch.bfloat16))}
for C in (4096, 6144, 8192):
    g = torch.randn(C, V, device=dev, dtype=torch.bfloat16)
    x = torch.randn(C, D, device=dev, dtype=torch.bfloat16)
    out[f"C{C}"] = {
        "addmm_fp32_ms": t(lambda: torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)),
        "mm_fp32_ms": t(lambda: torch.mm(g.t(), x, out_dtype=torch.float32)),
        "mm_bf16_ms": t(lambda: torch.mm(g.t(), x)),
        "logits_mm_ms": t(lambda: torch.mm(x, torch.empty(V, D, device=dev, dtype=torch.bfloat16).t())),
    }
    del g, x
print(json.dumps(out, indent=1))
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/dwcost.json", "w"), indent=1)
