"""Session 11 probe (not part of the package): the lean route's time against its vocab block size
(vpce.triton_backend.LEAN_BLOCK_GIB patched per run), both default heads, with the floor in the same process, and a
kernel profile of the Gemma lean step at the default block."""
import sys
import torch
from triton.testing import do_bench
import vpce
from vpce import triton_backend as tb

def floor_ms(x, w, g):
    return sum(do_bench(f, warmup=5, rep=200) for f in (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x))

def main():
    torch.manual_seed(0)
    for name, (n, d, v) in {"gemma2-2b": (8192, 2304, 256000), "llama3-8b": (16384, 4096, 128256)}.items():
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(v, d, device="cuda") / d**0.5).to(torch.bfloat16)
        y = torch.randint(0, v, (n,), device="cuda")
        g = torch.randn(n, v, device="cuda").to(torch.bfloat16)
        fl = floor_ms(x, w, g)
        del g
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()

        def step():
            xs.grad = ws.grad = None
            vpce.linear_cross_entropy(xs, ws, y, backend="triton", memory_budget="lean").backward()
        for gib in (0.2, 0.3, 0.4, 0.6):
            tb.LEAN_BLOCK_GIB = gib
            step(); torch.cuda.synchronize()
            xs.grad = ws.grad = None
            torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(); torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            ms = do_bench(step, warmup=3, rep=1500)
            print(f"{name} block {gib:.1f} GiB: {ms:8.2f} ms  {ms / fl:.4f}x floor {fl:.2f}  peak extra {peak:.2f} GiB", flush=True)
        tb.LEAN_BLOCK_GIB = 0.2
        if name == "gemma2-2b":
            from torch.profiler import profile, ProfilerActivity
            step(); torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
            tab = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    k = e.name[:80]
                    t = tab.setdefault(k, [0, 0.0]); t[0] += 1; t[1] += e.device_time / 1e3
            for k, (c, ms) in sorted(tab.items(), key=lambda kv: -kv[1][1])[:14]:
                print(f"   {ms / 2:8.3f} ms/step  x{c // 2:<4d} {k}")
        del xs, ws, x, w
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
