"""Session 11 probe: a Chrome trace of two lean steps on the Gemma-2-2B head (the GPU's idle gaps and what ran
before them), and the step time from back-to-back steps against the kernels' sum."""
import gzip, json, os, sys
import torch
import vpce
from torch.profiler import profile, ProfilerActivity

n, d, v = 8192, 2304, 256000
torch.manual_seed(0)
x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
w = (torch.randn(v, d, device="cuda") / d**0.5).to(torch.bfloat16).requires_grad_()
y = torch.randint(0, v, (n,), device="cuda")

def step():
    x.grad = w.grad = None
    vpce.linear_cross_entropy(x, w, y, backend="triton", memory_budget="lean").backward()

for _ in range(3):
    step()
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(10):
    step()
e.record(); torch.cuda.synchronize()
print(f"back-to-back: {s.elapsed_time(e) / 10:.2f} ms per step")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
out = os.environ.get("OUT", "/tmp")
path = f"{out}/lean-gemma-trace.json"
prof.export_chrome_trace(path)
t = json.load(open(path))
ev = sorted([q for q in t["traceEvents"] if q.get("ph") == "X" and q.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda q: q["ts"])
busy = sum(q["dur"] for q in ev)
span = ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]
print(f"profiled: span {span / 2e3:.2f} ms per step, kernels {busy / 2e3:.2f} ms per step")
end = ev[0]["ts"] + ev[0]["dur"]
for a, b in zip(ev, ev[1:]):
    gap = b["ts"] - max(end, a["ts"] + a["dur"])
    end = max(end, a["ts"] + a["dur"])
    if gap > 40:
        print(f"gap {gap:8.1f} us at {a['ts'] - ev[0]['ts']:9.1f}: after {a['name'][:50]} before {b['name'][:50]}")
with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
    g.write(f.read())
os.remove(path)
