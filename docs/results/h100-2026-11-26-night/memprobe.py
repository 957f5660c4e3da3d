"""Where is the HF step's peak? Run from a tree dir: python memprobe.py PATH LABEL (repo root on sys.path for launch/)."""
import collections, os, sys, time
sys.path.append(os.environ["REPO"])
import psize  # noqa: F401  (P share from $PSHARE)
import torch
from launch.train_step import ModelShape, RunShape, build_llama, hf_patch, hf_examples, corpus_tokens

path, label = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")
shape, run = ModelShape(), RunShape()
tokens, eod = corpus_tokens()
model = hf_patch(build_llama(shape, run.seq, run.seed, dev), path, False)
opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.0)
ex = hf_examples(tokens, eod, run, 4)
G = 2**30
def step(i, phases):
    batch = {k: torch.stack([ex[i][k]]).to(dev) for k in ("input_ids", "labels")}
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch).loss
    torch.cuda.synchronize(); phases.append(("fwd", torch.cuda.max_memory_allocated() / G, torch.cuda.memory_allocated() / G))
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize(); phases.append(("bwd", torch.cuda.max_memory_allocated() / G, torch.cuda.memory_allocated() / G))
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize(); phases.append(("opt", torch.cuda.max_memory_allocated() / G, torch.cuda.memory_allocated() / G))
    opt.zero_grad(set_to_none=True)
for i in range(2):
    step(i, [])
torch.cuda.memory._record_memory_history(max_entries=200000)
ph = []
step(2, ph)
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
print(label, path, "share", os.environ.get("PSHARE"), " ".join(f"{n}:peak={p:.2f},end={e:.2f}" for n, p, e in ph))
# replay the trace: live set at the peak
live, total, best, best_live, best_i = {}, 0, -1, None, 0
events = [e for tr in snap["device_traces"] for e in tr]
# allocations alive before the trace began: from segments' active blocks minus those allocated in trace
base = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
for i, e in enumerate(events):
    if e["action"] == "alloc":
        live[e["addr"]] = e; total += e["size"]
    elif e["action"] in ("free_completed",):
        x = live.pop(e["addr"], None)
        if x is not None: total -= x["size"]
    if total > best:
        best, best_live, best_i = total, dict(live), i
def where(e):
    fr = e.get("frames", [])
    keep = [f for f in fr if any(k in f["filename"] for k in ("vpce", "transformers/", "torch/optim", "launch", "liger", "autograd"))]
    f = (keep or fr or [{"filename": "?", "line": 0, "name": "?"}])
    return " < ".join(f"{os.path.basename(x['filename'])}:{x['line']}:{x['name']}" for x in f[:3])
print(f"  trace peak over start: {best / G:.2f} GiB at event {best_i}/{len(events)}; live then (new in step) by site:")
agg = collections.Counter(); cnt = collections.Counter()
for e in best_live.values():
    agg[where(e)] += e["size"]; cnt[where(e)] += 1
for k, v in agg.most_common(14):
    print(f"    {v / G:6.3f} GiB x{cnt[k]:3d}  {k}")

torch.cuda.synchronize(); t0 = time.perf_counter()
for i in range(10):
    step(i % 4, [])
torch.cuda.synchronize()
print(f"  step {1e3 * (time.perf_counter() - t0) / 10:.2f} ms (mean of 10, manual loop)")
