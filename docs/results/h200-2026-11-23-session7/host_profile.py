"""Host (Python) time of a vpce step: cProfile of steps, and the CPU time before the first kernel."""
import cProfile, io, math, pstats, sys, time, torch
sys.path.insert(0, ".")
import vpce
dev, bf = "cuda", torch.bfloat16

def ce_step(n, d, v, **kw):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, d, device=dev, dtype=bf, generator=g).requires_grad_()
    w = (torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)).to(bf).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    def step():
        x.grad = w.grad = None
        vpce.linear_cross_entropy(x, w, t, **kw).backward()
    return step

def distill_step(n, ds, dt, v, **kw):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, ds, device=dev, dtype=bf, generator=g).requires_grad_()
    w = (torch.randn(v, ds, device=dev, generator=g) / math.sqrt(ds)).to(bf).requires_grad_()
    ht = torch.randn(n, dt, device=dev, dtype=bf, generator=g)
    wt = (torch.randn(v, dt, device=dev, generator=g) / math.sqrt(dt)).to(bf)
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    def step():
        x.grad = w.grad = None
        vpce.linear_distillation_loss(x, w, ht, wt, t, **kw).backward()
    return step

cases = [("ce llama N=16384", ce_step(16384, 4096, 128256)), ("ce small N=512 V=8192", ce_step(512, 256, 8192)),
         ("distill fkl N=16384", distill_step(16384, 4096, 8192, 128256)),
         ("distill small", distill_step(512, 256, 256, 8192))]
for name, step in cases:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # CPU time of one call when the GPU queue is empty: time to return from forward+backward (async launches)
    ts = []
    for _ in range(5):
        torch.cuda.synchronize(); a = time.perf_counter(); step(); b = time.perf_counter(); torch.cuda.synchronize()
        ts.append((b - a) * 1e3)
    # GPU idle at the start: event recorded before the call vs a kernel the call launches first (approx: profile)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize(); step(); torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    t0 = min(e.time_range.start for e in cpu)
    first = min(e.time_range.start for e in ev) if ev else float("nan")
    last = max(e.time_range.end for e in ev) if ev else float("nan")
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    print(f"## {name}: CPU per call (async) {sorted(ts)[2]:.2f} ms; profiled: first kernel at +{(first - t0) / 1e3:.2f} ms, "
          f"kernels end at +{(last - t0) / 1e3:.2f} ms, kernel busy {busy / 1e3:.2f} ms", flush=True)
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(5):
        step()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print("\n".join(l for l in s.getvalue().splitlines() if l.strip())[:6000])
