"""Session 10: per step of a torch.profiler Chrome trace (a step starts at the fingerprint H2D copy): span, busy,
idle, GPU time by kernel, and the gaps of the last step. Usage: python trace_steps.py TRACE.json"""
import json, sys, collections
tr = json.load(open(sys.argv[1])); ev = tr["traceEvents"]
kern = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e], key=lambda e: e["ts"])
comp = [k for k in kern if "nccl" not in k["name"].lower()]
# step boundaries: kernels at index of the fingerprint H2D memcpy
starts = [i for i, k in enumerate(comp) if "HtoD" in k["name"]]
print("steps at", starts, "n", len(comp))
for a, b in zip(starts, starts[1:] + [len(comp)]):
    ks = comp[a:b]
    span = (ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]) / 1e3
    cat = collections.Counter()
    for k in ks:
        n = k["name"]
        c = "gemm" if "nvjet" in n or "gemm" in n.lower() else ("vpce" if n.startswith("_") else "torch-small")
        cat[c] += k["dur"] / 1e3
    busy = sum(cat.values())
    print(f"span {span:.3f} busy {busy:.3f} idle {span - busy:.3f}", {k: round(v, 3) for k, v in cat.items()})
    g = collections.Counter(); c2 = collections.Counter()
    for k in ks:
        g[k["name"][:50]] += k["dur"] / 1e3; c2[k["name"][:50]] += 1
    for n, v in g.most_common(12): print(f"   {v:8.3f} x{c2[n]:3d} {n}")
print("gaps in last step (rank file):")
ks = comp[starts[-1]:]
tot = 0
for a, b in zip(ks, ks[1:]):
    g = (b["ts"] - a["ts"] - a["dur"]) / 1e3
    if g > 0.01:
        tot += g
        print(f"  {(b['ts']-ks[0]['ts'])/1e3:8.3f} gap {g:.3f} after {a['name'][:35]} before {b['name'][:35]}")
print("sum", tot)
