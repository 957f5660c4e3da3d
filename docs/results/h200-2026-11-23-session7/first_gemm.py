"""When does the first GEMM launch after a vpce call starts? CPU-side timeline of one fast-route step."""
import math, sys, time, torch
sys.path.insert(0, ".")
import vpce
dev, bf = "cuda", torch.bfloat16
for (n, d, v) in ((16384, 4096, 128256), (8192, 2304, 256000)):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, d, device=dev, dtype=bf, generator=g).requires_grad_()
    w = (torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)).to(bf).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    def step():
        x.grad = w.grad = None
        vpce.linear_cross_entropy(x, w, t).backward()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            torch.cuda.synchronize()
            with torch.profiler.record_function("STEP"):
                step()
            torch.cuda.synchronize()
    ev = list(prof.events())
    steps = sorted([e for e in ev if e.name == "STEP" and e.device_type == torch.autograd.DeviceType.CPU], key=lambda e: e.time_range.start)
    s0 = steps[-1].time_range.start
    s1 = steps[-1].time_range.end
    cpu = sorted([e for e in ev if e.device_type == torch.autograd.DeviceType.CPU and s0 <= e.time_range.start <= s1 and e.name != "STEP"], key=lambda e: e.time_range.start)
    gpu = sorted([e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= s0], key=lambda e: e.time_range.start)
    print(f"## N={n} D={d} V={v}: step CPU {(s1 - s0) / 1e3:.2f} ms")
    first_mm = next((e for e in cpu if e.name in ("aten::mm", "aten::addmm")), None)
    print(f"  first aten::mm/addmm on the CPU at +{(first_mm.time_range.start - s0) / 1e3:.3f} ms" if first_mm else "  no mm")
    gm = next((e for e in gpu if "nvjet" in e.name or "gemm" in e.name.lower()), None)
    print(f"  first GPU kernel at +{(gpu[0].time_range.start - s0) / 1e3:.3f} ms ({gpu[0].name[:50]}); first GEMM kernel at +{(gm.time_range.start - s0) / 1e3:.3f} ms")
    # top-level CPU ops before the first mm (depth: ops not contained in another listed op)
    top = []
    for e in cpu:
        if first_mm and e.time_range.start >= first_mm.time_range.start:
            break
        if top and e.time_range.end <= top[-1].time_range.end:
            continue
        top.append(e)
    for e in top[:60]:
        print(f"  +{(e.time_range.start - s0) / 1e3:7.3f} ms  {(e.time_range.end - e.time_range.start) / 1e3:7.3f} ms  {e.name[:70]}")
    del x, w
    torch.cuda.empty_cache()
