"""Session 9: idle time on the compute stream of a torch.profiler Chrome trace, step by step (rank 0)."""
import json, sys, collections
tr = json.load(open(sys.argv[1]))
ev = tr["traceEvents"] if isinstance(tr, dict) else tr
kern = [e for e in ev if e.get("cat") == "kernel" and "dur" in e]
steps = sorted([e for e in ev if e.get("cat") in ("user_annotation",) and str(e.get("name", "")).startswith("vpce-step")], key=lambda e: e["ts"])
by_stream = collections.defaultdict(float)
for e in kern:
    if "nccl" not in e["name"].lower():
        by_stream[e.get("tid")] += e["dur"]
main = max(by_stream, key=by_stream.get)
comp = sorted([e for e in kern if e.get("tid") == main], key=lambda e: e["ts"])
nccl = sorted([e for e in kern if "nccl" in e["name"].lower()], key=lambda e: e["ts"])
print(f"compute stream {main}; streams: { {k: round(v / 1e3, 1) for k, v in by_stream.items()} }")
for i, st in enumerate(steps):
    t0 = st["ts"]
    t1 = steps[i + 1]["ts"] if i + 1 < len(steps) else max(e["ts"] + e["dur"] for e in comp)
    ks = [e for e in comp if t0 <= e["ts"] < t1]
    if not ks:
        continue
    busy = sum(e["dur"] for e in ks)
    end = ks[-1]["ts"] + ks[-1]["dur"]
    print(f"step {i}: cpu start -> first kernel {(ks[0]['ts'] - t0) / 1e3:.3f} ms; first kernel -> last end {(end - ks[0]['ts']) / 1e3:.3f} ms; busy {busy / 1e3:.3f} ms; idle {(end - ks[0]['ts'] - busy) / 1e3:.3f} ms; kernels {len(ks)}")
    gaps = []
    for a, b in zip(ks, ks[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > 15:
            ov = [n["name"][:30] for n in nccl if n["ts"] < b["ts"] and n["ts"] + n["dur"] > a["ts"] + a["dur"]]
            gaps.append((g, a["name"][:40], b["name"][:40], ov[:2]))
    for g, a, b, ov in gaps[:40]:
        print(f"   gap {g / 1e3:.3f} ms after {a} before {b}; nccl during: {ov}")
    print(f"   gaps > 15 us: {len(gaps)}, sum {sum(g[0] for g in gaps) / 1e3:.3f} ms")
