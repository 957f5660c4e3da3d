"""GPU idle gaps per profiled step in a Chrome trace (all streams of the device): gaps > 15 us, with the kernels
on either side. Usage: gaps.py trace.json"""
import json, sys
d = json.load(open(sys.argv[1])); ev = d["traceEvents"]
kern = sorted([e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")],
              key=lambda e: e["ts"])
gst = sorted([e for e in ev if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("vpce-step")],
             key=lambda e: e["ts"])
for s in gst:
    t0, t1 = s["ts"], s["ts"] + s["dur"]
    ks = [k for k in kern if t0 <= k["ts"] < t1]
    end = t0; busy = 0.0; gaps = []
    last = None
    for k in ks:
        if k["ts"] > end + 15:
            gaps.append((k["ts"] - end, last, k["name"], k["ts"] - t0))
        if k["ts"] + k["dur"] > end:
            busy += k["ts"] + k["dur"] - max(end, k["ts"]); end = k["ts"] + k["dur"]; last = k["name"]
    print(f"{s['name']}: span {s['dur'] / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, idle {(s['dur'] - busy) / 1e3:.3f} ms")
    for g, a, b, at in gaps:
        print(f"   gap {g / 1e3:.3f} ms at {at / 1e3:.3f}: after {str(a)[:50]} -> before {b[:50]}")
