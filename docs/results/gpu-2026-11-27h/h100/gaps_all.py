"""GPU idle gaps over a whole profiled window (every kernel, memcpy and memset of the device, all streams): from the
first kernel to the last, each gap > 20 us with the kernels on either side, and the total idle time per step
(the window / the profiled steps). Usage: gaps_all.py trace.json steps"""
import json, sys
d = json.load(open(sys.argv[1])); steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ev = d["traceEvents"]
kern = sorted([e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")],
              key=lambda e: e["ts"])
t0 = kern[0]["ts"]; end = t0; busy = 0.0; gaps = []; last = None
for k in kern:
    if k["ts"] > end + 20:
        gaps.append((k["ts"] - end, last, k["name"], end - t0))
    if k["ts"] + k["dur"] > end:
        busy += k["ts"] + k["dur"] - max(end, k["ts"]); end = k["ts"] + k["dur"]; last = k["name"]
span = end - t0
print(f"window {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms; per step (/{steps}): "
      f"span {span / steps / 1e3:.3f}, idle {(span - busy) / steps / 1e3:.3f} ms; gaps > 20 us: {len(gaps)}")
for g, a, b, at in gaps:
    print(f"  gap {g / 1e3:.3f} ms at {at / 1e3:9.3f}: after {str(a)[:60]} -> before {b[:60]}")
# host side: where the CPU ops of each step that run long (cudaStreamSynchronize, cudaDeviceSynchronize, item)
sync = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
        and ("ynchronize" in e["name"] or "EventQuery" in e["name"] or "Memcpy" in e["name"]) and e["dur"] > 20]
for e in sorted(sync, key=lambda e: e["ts"])[:40]:
    print(f"  host {e['name']} {e['dur'] / 1e3:.3f} ms at {(e['ts'] - t0) / 1e3:9.3f}")
