"""Twelfth session: the tp=2 floor and vpce's step each timed after a second of untimed steps of its own (the power
cap settled), two rounds: the floor as the bench takes it (each of the three cuBLAS GEMMs looped and timed alone,
medians summed) and as one step of the three GEMMs; vpce's fwd+bwd as bench_tp calls it (Llama-3-8B head). Fixed
step counts on every rank (vpce's steps hold collectives).

    torchrun --standalone --nproc-per-node 2 settle.py
"""
import os
import statistics

import torch
import torch.distributed as dist

import vpce

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dev = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl", device_id=dev)
n, d, vocab, world = 16384, 4096, 128256, dist.get_world_size()
v = vocab // world
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
w = (torch.randn(v, d, device=dev, generator=g) / d ** 0.5).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, vocab, (n,), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
G = torch.randn(n, v, device=dev, generator=g).to(torch.bfloat16)
xd, wd = x.detach(), w.detach()
gemm = {"logits": lambda: torch.mm(xd, wd.t()), "dx": lambda: torch.mm(G, wd), "dw": lambda: torch.mm(G.t(), xd)}


def floor_step():
    for f in gemm.values():
        f()


def step():
    x.grad = w.grad = None
    loss = vpce.linear_cross_entropy(x, w, t, group=dist.group.WORLD, vocab_start=rank * v, vocab_size=vocab,
                                     backend="triton")
    loss.backward()


def timed(fn, settle, reps):
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(settle):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


for _ in range(2):
    floor_step(); step()
out = []
for rnd in range(2):
    sep = {k: timed(f, 80, 125) for k, f in gemm.items()}
    res = dict(round=rnd, sep=sum(sep.values()), parts=sep, step_floor=timed(floor_step, 28, 40), vpce=timed(step, 26, 40))
    res["vpce_cold"] = timed(step, 0, 40)  # after a barrier and no settling, as a contrast
    out.append(res)
every = [None] * world
dist.all_gather_object(every, out)
if rank == 0:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for rk, rows in enumerate(every):
        for r in rows:
            print(f"rank {rk} round {r['round']}: floor as the bench takes it {r['sep']:.2f} ms (" +
                  " ".join(f"{k} {x:.2f}" for k, x in r['parts'].items()) + f"), floor as one step "
                  f"{r['step_floor']:.2f}; vpce {r['vpce']:.2f} (x {r['vpce'] / r['sep']:.4f} / {r['vpce'] / r['step_floor']:.4f}),"
                  f" vpce unsettled {r['vpce_cold']:.2f}", flush=True)
dist.barrier()
dist.destroy_process_group()
