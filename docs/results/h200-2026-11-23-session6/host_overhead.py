"""Is the step host-bound? event timing with and without a sleep kernel queued ahead; host enqueue time; clocks."""
import math, statistics, sys, time, subprocess, os, torch
import vpce, vpce.triton_backend as tb

def timed(fn, reps=15, warm=3, presleep=False):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []; hs = []
    for _ in range(reps):
        if presleep:
            torch.cuda._sleep(int(2e8))  # ~100 ms at 1.98 GHz: the host enqueues the whole step meanwhile
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); h0 = time.perf_counter(); fn(); h1 = time.perf_counter(); b.record()
        torch.cuda.synchronize(); ts.append(a.elapsed_time(b)); hs.append((h1 - h0) * 1e3)
    return statistics.median(ts), statistics.median(hs)

dev = torch.device("cuda")
shapes = {"llama3-8b": (16384, 4096, 128256), "gemma2-2b": (8192, 2304, 256000)}
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                        "--format=csv,noheader", "-lms", "100"], stdout=open(os.environ["OUT"] + "/smi.csv", "w"))
for name in sys.argv[1].split(","):
    N, D, V = shapes[name]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, D, device=dev, generator=g).bfloat16()
    w = (torch.randn(V, D, device=dev, generator=g) / math.sqrt(D)).bfloat16()
    y = torch.randint(0, V, (N,), device=dev, generator=g)
    G = torch.randn(N, V, device=dev, dtype=torch.bfloat16, generator=g)
    f3 = lambda: (x @ w.T, G @ w, G.T @ x)
    xs = x.clone().requires_grad_(); ws = w.clone().requires_grad_()
    def step(**kw):
        def f():
            xs.grad = None; ws.grad = None
            vpce.linear_cross_entropy(xs, ws, y, **kw).backward()
        return f
    print(f"## {name}", flush=True)
    for rep in range(2):
        for key in ("floor", "old", "new", "new-fastbudget"):
            fn = f3 if key == "floor" else step(**({"memory_budget": 1.5} if "budget" in key else {}))
            tb._STORED = key.startswith("new")
            print(f"{time.strftime('%H:%M:%S')} {key:15s}", end="", flush=True)
            for pre in (False, True):
                ms, host = timed(fn, presleep=pre)
                print(f"  presleep={int(pre)}: {ms:7.2f} ms (host enqueue {host:6.2f} ms)", end="", flush=True)
            print(flush=True)
    del G, x, w, xs, ws; torch.cuda.empty_cache()
smi.terminate()
