"""Session 10: per kernel of a torch.profiler Chrome trace, its GPU start, duration, gap and launch-to-start latency.
Usage: python trace_launch.py TRACE.json FROM_MS TO_MS"""
import json, sys
tr = json.load(open(sys.argv[1])); ev = tr["traceEvents"]
kern = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
rt = {e["args"]["correlation"]: e for e in ev if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
kern.sort(key=lambda e: e["ts"])
lo, hi = float(sys.argv[2]), float(sys.argv[3])
t0 = kern[0]["ts"]
prev_end = None
for k in kern:
    t = (k["ts"] - t0) / 1e3
    if not (lo <= t <= hi): 
        prev_end = k["ts"] + k["dur"]; continue
    c = rt.get(k["args"].get("correlation"))
    lat = (k["ts"] - c["ts"]) / 1e3 if c else float("nan")
    gap = (k["ts"] - prev_end) / 1e3 if prev_end else 0
    print(f"{t:9.3f} +{k['dur']/1e3:7.3f} gap {gap:6.3f} launch->start {lat:7.3f} tid {k.get('tid')} {k['name'][:60]}")
    prev_end = max(prev_end or 0, k["ts"] + k["dur"])
