"""Twelfth session: energy per step (NVML's total-energy counter) and time per step of the tp=2 floor (three cuBLAS
GEMMs on the shard) and of vpce's fwd+bwd (Llama-3-8B head, N=16384, as bench_tp calls it), in alternating blocks
of 16 steps, 4 rounds. Under the 700 W power cap, does vpce's time over the floor's follow its energy over the
floor's?

    torchrun --standalone --nproc-per-node 2 energy.py
"""
import ctypes
import os
import statistics
import time

import torch
import torch.distributed as dist

import vpce

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dev = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl", device_id=dev)

nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
bus = torch.cuda.get_device_properties(dev).pci_bus_id if hasattr(torch.cuda.get_device_properties(dev),
                                                                    "pci_bus_id") else None
if not (bus and nvml.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)) == 0):
    assert nvml.nvmlDeviceGetHandleByIndex_v2(dev.index, ctypes.byref(handle)) == 0
    bus = f"index {dev.index}"
print(f"rank {rank}: NVML handle by {bus}", flush=True)


def energy_mj():
    e = ctypes.c_ulonglong()
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(e)) == 0
    return e.value


n, d, vocab, world = 16384, 4096, 128256, dist.get_world_size()
v = vocab // world
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
w = (torch.randn(v, d, device=dev, generator=g) / d ** 0.5).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, vocab, (n,), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
G = torch.randn(n, v, device=dev, generator=g).to(torch.bfloat16)
xd, wd = x.detach(), w.detach()


def floor():
    torch.mm(xd, wd.t())
    torch.mm(G, wd)
    torch.mm(G.t(), xd)


def step():
    x.grad = w.grad = None
    loss = vpce.linear_cross_entropy(x, w, t, group=dist.group.WORLD, vocab_start=rank * v, vocab_size=vocab,
                                     backend="triton")
    loss.backward()


def block(fn, steps=16):
    torch.cuda.synchronize()
    dist.barrier()
    e0, t0 = energy_mj(), time.perf_counter()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        fn()
    e.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    time.sleep(0.15)  # the counter's last update
    return s.elapsed_time(e) / steps, (energy_mj() - e0) / steps, wall


for _ in range(3):
    floor(); step()
got = {"floor": [], "vpce": []}
for r in range(4):
    for name, fn in (("floor", floor), ("vpce", step)) if r % 2 == 0 else (("vpce", step), ("floor", floor)):
        got[name].append(block(fn))
every = [None] * world
dist.all_gather_object(every, got)
if rank == 0:
    print(torch.cuda.get_device_name(), torch.__version__)
    for rk, res in enumerate(every):
        for name in ("floor", "vpce"):
            print(f"rank {rk} {name:5s} ms/step " + " ".join(f"{b[0]:.2f}" for b in res[name]) +
                  "  J/step " + " ".join(f"{b[1] / 1e3:.2f}" for b in res[name]) +
                  "  W " + " ".join(f"{b[1] / b[0]:.0f}" for b in res[name]))
        ms = [statistics.median(b[0] for b in res[k]) for k in ("floor", "vpce")]
        ej = [statistics.median(b[1] for b in res[k]) for k in ("floor", "vpce")]
        print(f"rank {rk}: time vpce/floor {ms[1] / ms[0]:.4f}, energy vpce/floor {ej[1] / ej[0]:.4f}")
dist.barrier()
dist.destroy_process_group()
