"""#36 item 4: per profiled step of launch/profile_tp.py's Chrome trace, where the call's first GEMM starts.
host: ms from the step's record_function start to the launch of its first GEMM kernel (the call begins at once:
the step only clears two .grad first); gpu: ms from the step's first GPU kernel start to that GEMM's start, and
from the previous step's last kernel end. Usage: first_gemm.py trace.json"""
import json, sys

GEMM = ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "gemv")
d = json.load(open(sys.argv[1]))
ev = d["traceEvents"] if isinstance(d, dict) else d
steps = sorted([e for e in ev if e.get("ph") == "X" and str(e.get("name", "")).startswith("vpce-step-")
                and e.get("cat") in ("user_annotation", "cpu_op", None)], key=lambda e: e["ts"])
steps = [s for s in steps if s.get("cat") == "user_annotation"] or steps
kern = sorted([e for e in ev if e.get("ph") == "X" and e.get("cat") == "kernel"], key=lambda e: e["ts"])
rt = {e["args"].get("correlation"): e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
      and "args" in e}
prev_end = None
for s in steps:
    t0, t1 = s["ts"], s["ts"] + s["dur"]
    # kernels launched from this step's host range
    mine = [k for k in kern if (r := rt.get(k["args"].get("correlation"))) is not None and t0 <= r["ts"] <= t1]
    if not mine:
        print(s["name"], "no kernels"); continue
    g = next((k for k in mine if any(p in k["name"].lower() for p in GEMM)), None)
    before = [k for k in mine if k["ts"] < g["ts"]] if g else []
    launch = rt[g["args"]["correlation"]]["ts"] if g else None
    print(f"{s['name']}: host call->first GEMM launch {(launch - t0) / 1e3 if g else -1:.3f} ms; "
          f"gpu first kernel->GEMM {(g['ts'] - mine[0]['ts']) / 1e3 if g else -1:.3f} ms "
          f"({len(before)} kernels before it, {sum(k['dur'] for k in before) / 1e3:.3f} ms of them); "
          f"prev step end->GEMM {(g['ts'] - prev_end) / 1e3 if (g and prev_end) else float('nan'):.3f} ms; "
          f"GEMM {g['name'][:60] if g else None}")
    for k in before[:12]:
        print(f"    {(k['ts'] - mine[0]['ts']) / 1e3:7.3f} +{k['dur'] / 1e3:.3f} {k['name'][:80]}")
    prev_end = max(k["ts"] + k["dur"] for k in mine)
