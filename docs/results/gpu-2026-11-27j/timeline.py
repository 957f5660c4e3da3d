"""Per-step timeline of a rank's chrome trace: compute-stream kernels in order (merged by kind), gaps on the compute
stream and what NCCL runs meanwhile, each GEMM's time with/without NCCL beside it. Usage: timeline.py trace.json
[--full]. ``--full`` (added in the eleventh session, gpu-2026-11-27k): whole steps (forward and backward: the
windows end with the cast after a dW GEMM, as where the trace has no step annotations; the annotations cover only
the main thread's launches, not the autograd thread's backward), and the idle time before each step's first
kernel ("lead")."""
import json, sys, collections
FULL = "--full" in sys.argv[2:]
ev = json.load(open(sys.argv[1])); ev = ev["traceEvents"] if isinstance(ev, dict) else ev
kern = sorted([e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")],
              key=lambda e: e["ts"])
steps = sorted([e for e in ev if e.get("ph") == "X" and str(e.get("name", "")).startswith("vpce-step-")
                and e.get("cat") in ("user_annotation", "gpu_user_annotation")], key=lambda e: e["ts"])
gsteps = [e for e in steps if e.get("cat") == "gpu_user_annotation"]
def short(n):
    for k, s in (("vpce_stats", "STATS"), ("quackgemm_default", "DW"), ("nvjet", "DX"), ("AllReduce", "AR"),
                 ("AllGather", "AG"), ("_stored_logits", "grad"), ("_scale_cast", "cast"), ("combine_rank", "comb")):
        if k in n: return s
    return "small"
isnccl = lambda e: "nccl" in e["name"].lower()
comp = [e for e in kern if not isnccl(e)]; comm = [e for e in kern if isnccl(e)]
# step windows from the compute stream: split at the first STATS kernel of each step (4 + ... ), use gpu annotations if any
if gsteps and not FULL:
    wins = [(s["ts"], s["ts"] + s["dur"]) for s in gsteps]
else:
    wins, start, seen_dw = [], comp[0]["ts"], False
    for i, e in enumerate(comp):  # a step ends with the cast after its DW GEMM (dX's scale and cast)
        seen_dw = seen_dw or short(e["name"]) == "DW"
        if seen_dw and short(e["name"]) == "cast" and (i + 1 == len(comp) or short(comp[i + 1]["name"]) != "cast"):
            wins.append((start, e["ts"] + e["dur"])); seen_dw = False
            if i + 1 < len(comp): start = comp[i + 1]["ts"]
print("gpu step annotations:", len(gsteps))
def overlap(a0, a1, ivs):
    return sum(max(0, min(a1, b1) - max(a0, b0)) for b0, b1 in ivs)
civ = [(e["ts"], e["ts"] + e["dur"]) for e in comm]
tot = collections.defaultdict(lambda: [0.0, 0.0, 0])
prev_end = None
for si, (w0, w1) in enumerate(wins):
    ks = [e for e in comp if w0 - 50 <= e["ts"] < w1]
    cs = [e for e in comm if w0 - 50 <= e["ts"] < w1]
    if not ks: continue
    t0 = ks[0]["ts"]
    line = []; end = t0; gap_total = 0.0; gaps = []
    last = None
    for e in ks:
        if e["ts"] > end + 3:
            g = e["ts"] - end; gap_total += g
            busy = [short(c["name"]) for c in cs if c["ts"] < e["ts"] and c["ts"] + c["dur"] > end]
            gaps.append(f"gap {g/1e3:.3f} before {short(e['name'])} after {last} (nccl: {','.join(busy) or '-'})")
        s = short(e["name"]); last = s
        ov = overlap(e["ts"], e["ts"] + e["dur"], civ)
        tot[s][0] += e["dur"]; tot[s][1] += ov; tot[s][2] += 1
        if s != "small":
            line.append(f"{s}@{(e['ts']-t0)/1e3:.2f}:{e['dur']/1e3:.2f}" + (f"(ov{ov/1e3:.2f})" if ov > 0 else ""))
        end = max(end, e["ts"] + e["dur"])
    lead = "" if prev_end is None else f", lead {(t0 - prev_end)/1e3:.3f}"
    prev_end = end
    print(f"-- step {si}: span {(end - t0)/1e3:.3f} ms, compute busy {sum(e['dur'] for e in ks)/1e3:.3f}, gaps {gap_total/1e3:.3f}{lead}")
    print("   " + " ".join(line))
    for g in gaps: print("   " + g)
    print("   nccl: " + " ".join(f"{short(c['name'])}@{(c['ts']-t0)/1e3:.2f}:{c['dur']/1e3:.2f}" for c in cs))
n = max(1, len(wins))
print("per step by kind: total ms / overlapped-with-nccl ms / count")
for s, (d, o, c) in sorted(tot.items(), key=lambda x: -x[1][0]):
    print(f"   {s:6s} {d/1e3/n:8.3f} {o/1e3/n:8.3f} {c/n:5.1f}")
