# per-kernel total GPU time over the profiled steps of a chrome trace (top 14), per rank
import json, sys, collections
for f in sys.argv[1:]:
    ev = json.load(open(f))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    k = collections.defaultdict(lambda: [0.0, 0])
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            n = e["name"][:90]; k[n][0] += e["dur"]; k[n][1] += 1
    print("==", f, "total ms", round(sum(v[0] for v in k.values()) / 1e3, 2))
    for n, (d, c) in sorted(k.items(), key=lambda x: -x[1][0])[:14]:
        print(f"  {d/1e3:9.2f} ms {c:4d}x  {n}")
