"""Written at the end of the eleventh session, not yet run: does a collective that waits for a late rank slow the
GEMM beside it less when its copies run on copy engines (torch's symmetric-memory "low-contention" all-gather:
one-CTA barriers around cudaMemcpy pulls) than as NCCL's kernels? tp=2's dX sum is the case: one rank reaches
it early and its NCCL channels spin on SMs beside that rank's next GEMM.

    torchrun --standalone --nproc-per-node 2 ce_probe.py [--gemm quack|cublas] [--late-ms 1.0] [--reps 10]

Per variant, rank 0's median ms over ``reps``: the GEMM alone; the GEMM with the exchange of a [8192, 4096] fp32
dX chunk issued just before it, rank 1 joining ``--late-ms`` later (``torch.cuda._sleep`` on rank 1 first), as
NCCL's all-reduce (``nccl``) and as the copy-engine all-gather (``ce``: each rank pulls the peer's partial; the
sum would go into the backward's scale-and-cast); and the whole step (GEMM + exchange waited). The GEMM: quack's
dW GEMM with the dynamic persistent scheduler as vpce runs it (``--gemm quack``, the hopper extra), or cuBLAS
(``torch.mm``) of the same shape. Prints the versions first (torch, NCCL, whether the symmetric-memory ops exist).
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist

ap = argparse.ArgumentParser()
ap.add_argument("--gemm", default="quack", choices=("quack", "cublas"))
ap.add_argument("--late-ms", type=float, default=1.0)
ap.add_argument("--reps", type=int, default=10)
a = ap.parse_args()

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dev = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl", device_id=dev)
group = dist.group.WORLD
say = print if rank == 0 else (lambda *x, **k: None)
say(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {torch.cuda.get_device_name()}")
try:
    import torch.distributed._symmetric_memory as symm_mem
    has_ce = hasattr(torch.ops.symm_mem, "_low_contention_all_gather")
except ImportError as e:
    symm_mem, has_ce = None, False
    say("no symmetric memory:", e)
say("low-contention all-gather:", has_ce)

n, d, v = 8192, 4096, 64128  # one tp=2 chunk of the Llama-3-8B head: dX rows, hidden, vocab rows per rank
g = torch.randn(n, v, device=dev).to(torch.bfloat16)
x = torch.randn(n, d, device=dev).to(torch.bfloat16)
one = torch.ones((), device=dev)
if a.gemm == "quack":
    from vpce.gemm import scaled_weight_grad

    def gemm():  # dW = g^T x in bf16, quack's dynamic persistent scheduler (vpce's backward GEMM)
        return scaled_weight_grad(None, g, x, one, torch.bfloat16)
else:
    def gemm():
        return torch.mm(g.t(), x)

dx = torch.randn(n, d, device=dev)  # this rank's fp32 dX partial
if has_ce:
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op or absent later
        symm_mem.enable_symm_mem_for_group(group.group_name)
    buf = symm_mem.empty(n, d, dtype=torch.float32, device=dev)
    symm_mem.rendezvous(buf, group.group_name)
    buf.copy_(dx)
# cycles of torch.cuda._sleep per ms, measured here
t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda._sleep(1000000)
t0.record(); torch.cuda._sleep(10000000); t1.record(); torch.cuda.synchronize()
late = int(a.late_ms * 10000000 / t0.elapsed_time(t1))
say(f"_sleep: {10000000 / t0.elapsed_time(t1):.0f} cycles per ms")


def exchange(kind):
    if kind == "nccl":
        return dist.all_reduce(dx, group=group, async_op=True)
    out = torch.ops.symm_mem._low_contention_all_gather(buf, group.group_name)
    return out


def finish(kind, work):
    if kind == "nccl":
        work.wait()
    else:
        torch.ops._c10d_functional.wait_tensor(work)


def run(kind):
    gem, whole = [], []
    for _ in range(a.reps + 2):
        dist.barrier()
        torch.cuda.synchronize()
        s, m, e = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        if rank == 1 and kind != "alone":
            torch.cuda._sleep(late)  # rank 1 joins late: rank 0's collective waits beside its GEMM
        s.record()
        work = None if kind == "alone" else exchange(kind)
        gemm()
        m.record()
        if work is not None:
            finish(kind, work)
        e.record()
        torch.cuda.synchronize()
        gem.append(s.elapsed_time(m))
        whole.append(s.elapsed_time(e))
    return statistics.median(gem[2:]), statistics.median(whole[2:])


for kind in ("alone", "nccl") + (("ce",) if has_ce else ()):
    got = run(kind)
    every = [None, None]
    dist.all_gather_object(every, got)
    say(f"{a.gemm:6s} {kind:6s} rank 0: GEMM {every[0][0]:.3f} ms, with the exchange waited {every[0][1]:.3f} ms; "
        f"rank 1: {every[1][0]:.3f} / {every[1][1]:.3f} (rank 1 {a.late_ms} ms late)")
dist.barrier()
dist.destroy_process_group()
