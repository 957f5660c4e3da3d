"""In-process interleaved A/B of tp=2 (or tp=1) vpce steps: variants toggled between blocks of steps, the floor's
three cuBLAS GEMMs on the shard interleaved too, so that clock drift hits every variant alike.
torchrun --nproc-per-node 2 ab.py [--rounds 20] [--steps 6] [--shape NxDxV]"""
import argparse, os, statistics, sys
import torch, torch.distributed as dist
import vpce, vpce.gemm as G, vpce.triton_backend as T
from vpce.bench.launch_env import init_process_group, local_cuda_device
ap = argparse.ArgumentParser(); ap.add_argument("--rounds", type=int, default=20); ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--shape", default="16384x4096x128256"); ap.add_argument("--variants", default="main,dyn,dynh,nohalf")
a = ap.parse_args()
n, d, v = (int(t) for t in a.shape.split("x"))
init_process_group("nccl", device_id=local_cuda_device())
rank, tp = dist.get_rank(), dist.get_world_size()
rows = v // tp; v = rows * tp
torch.manual_seed(0)
x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16); y = torch.randint(0, v, (n,), device="cuda")
dist.broadcast(x, 0); dist.broadcast(y, 0)
w = (torch.randn(rows, d, device="cuda") / d**0.5).to(torch.bfloat16).requires_grad_()
xs = x.clone().requires_grad_()
g = torch.randn(n, rows, device="cuda").to(torch.bfloat16)
layout = dict(group=dist.group.WORLD, vocab_start=rank * rows, vocab_size=v, sequence_parallel=False) if tp > 1 else {}
VARS = {"main": (False, True), "dyn": (True, True), "dynh": (True, False), "nohalf": (False, False)}
def setv(name):
    G.DYNAMIC, T.HALVES = VARS[name]; G._logits_config.cache_clear()
def vstep():
    xs.grad = w.grad = None
    vpce.linear_cross_entropy(xs, w, y, **layout).backward()
def fstep():
    torch.mm(x, w.t()); torch.mm(g, w); torch.mm(g.t(), x)
names = ["floor"] + a.variants.split(",")
times = {k: [] for k in names}
for k in names[1:]:
    setv(k); vstep(); vstep()
torch.cuda.synchronize(); dist.barrier()
for r in range(a.rounds):
    order = names if r % 2 == 0 else names[::-1]
    for k in order:
        if k != "floor": setv(k)
        fn = fstep if k == "floor" else vstep
        fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.steps)]
        for s, e in ev:
            s.record(); fn(); e.record()
        torch.cuda.synchronize()
        times[k] += [s.elapsed_time(e) for s, e in ev]
        dist.barrier()
med = {k: statistics.median(t) for k, t in times.items()}
every = [None] * tp; dist.all_gather_object(every, med)
if rank == 0:
    gpu = torch.cuda.get_device_name()
    print(f"A/B tp={tp} {a.shape} {a.rounds} rounds x {a.steps} steps, {gpu}")
    for k in names:
        ms = max(e[k] for e in every); fl = max(e["floor"] for e in every)
        print(f"  {k:8s} median {ms:8.3f} ms (ranks {' '.join(f'{e[k]:.3f}' for e in every)})  x floor {ms / fl:.4f}")
dist.barrier(); dist.destroy_process_group()
