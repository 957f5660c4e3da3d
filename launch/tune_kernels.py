"""Where the fast route's time goes, phase by phase, and launch/block-shape sweeps of its kernels (one GPU).

    python launch/tune_kernels.py [--shapes llama3-8b,gemma2-2b] [--chunk 4096]

For one token chunk of each head it times, with CUDA events (median of repeated runs): the cuBLAS logits GEMM
(bf16 out, what the fast route runs), the fused GEMM in stats-only mode (the lean route's forward), the stored
logits -> statistics pass, the fp32 target logits, the stored logits -> gradient pass (in place) and the two
cuBLAS gradient GEMMs (fp32 outputs). Then it times the two bandwidth passes over a few launch shapes and the
fused kernel over a list of block shapes. It prints TFLOP/s (GB/s for the memory-bound passes) next to each.
Notes for tuning, not a benchmark: the numbers that count come from ``python -m vpce.bench``. One process, one
GPU, no process group; this script imports the ``vpce`` of the checkout it sits in.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vpce import kernels  # noqa: E402
from vpce.backends.gemm import addmm_out_, mm_out  # noqa: E402

SHAPES = {"llama3-8b": (4096, 128256), "gemma2-2b": (2304, 256000)}
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 256, 64, 16, 8, 4), (128, 128, 64, 8, 8, 4),
]
# Tried and dropped, each slower than this grid on both heads (docs/benchmarks.md): a persistent schedule (one
# program per SM, flattened tile loop); P tiles written by tensor-descriptor (bulk copy) stores; 128x128 tiles with
# 2-3 stages (two programs per SM) and 64x256 tiles.


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def profile_step(d: int, v: int, n: int, **kw):
    """One vpce fwd+bwd under torch.profiler: GPU time per kernel against the step's wall time."""
    import vpce

    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, d, device="cuda") / math.sqrt(d)).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")

    def step():
        x.grad = w.grad = None
        vpce.linear_cross_entropy(x, w, t, **kw).backward()

    step_ms = ms(step)
    # host side: enqueue time of a step, and any operation that synchronizes with the device
    import time
    import warnings

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    enqueue = (time.perf_counter() - t0) / 5 * 1e3
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    torch.cuda.set_sync_debug_mode(0)
    syncs = [str(c.message)[:100] for c in caught if "synchron" in str(c.message).lower()]
    print(f"host enqueue per step {enqueue:.2f} ms; synchronizing ops in a step: {len(syncs)} {syncs[:3]}")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    cpu = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"  cpu {e.self_cpu_time_total / 1e3:8.3f} ms  x{e.count:<4d} {e.key[:80]}")
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 1e3
    print(f"\n## profile {kw or ''} N={n} D={d} V={v}: step {step_ms:.2f} ms, GPU busy {total:.2f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"  {e.self_device_time_total / 1e3:8.3f} ms  x{e.count:<4d} {e.key[:90]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama3-8b,gemma2-2b")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--profile-only", action="store_true", help="only the per-kernel profile of a full step")
    args = ap.parse_args()
    if args.profile_only:
        for name in args.shapes.split(","):
            d, v = SHAPES[name]
            profile_step(d, v, 16384 if name == "llama3-8b" else 8192)
        return
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for name in args.shapes.split(","):
        d, v = SHAPES[name]
        c = args.chunk
        x = torch.randn(c, d, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(v, d, device="cuda") / math.sqrt(d)).to(torch.bfloat16)
        t = torch.randint(0, v, (c,), device="cuda", dtype=torch.int32)
        bn = kernels.tile_n(x)
        n_tiles = triton.cdiv(v, bn)
        f32 = dict(device="cuda", dtype=torch.float32)
        tm, ts, zt = torch.empty(c, n_tiles, **f32), torch.empty(c, n_tiles, **f32), torch.zeros(c, **f32)
        p = torch.empty(c, v, device="cuda", dtype=torch.bfloat16)
        rows_ = (torch.zeros(c, **f32), torch.full((c,), 12.0, **f32), torch.full((c,), 0.5, **f32))
        scale = torch.full((c,), 1e-4, **f32)
        coef = (scale, None, -scale, None)  # plain cross-entropy: a = s, c = -s
        dw = torch.zeros(v, d, **f32)
        flop = 2 * c * d * v

        def stats(config=None):
            kernels.logits_tiles(x, w, None, t, tile_m=tm, tile_s=ts, zt=zt, config=config)

        def stored_stats(**launch):
            kernels.stored_logits(p, None, t, tile_m=tm, tile_s=ts, zt=zt, **launch)

        def stored_grad(**launch):
            kernels.stored_logits(p, None, t, rows=rows_, coef=coef, **launch)

        rows = [
            ("cuBLAS logits GEMM (bf16 out)", lambda: torch.mm(x, w.t(), out=p), flop),
            ("fused GEMM, stats only", stats, flop),
            ("stored logits -> stats", stored_stats, -1),
            ("target logits (fp32)", lambda: kernels.target_logits(x, w, None, t, zt), 0),
            ("stored logits -> dL/dz (in place)", stored_grad, -2),
            ("dX = dz @ W (fp32 out)", lambda: mm_out(p, w, torch.float32), flop),
            ("dW += dz.T @ X (fp32 acc)", lambda: addmm_out_(dw, p.t(), x), flop),
        ]
        print(f"\n## {name}: chunk C={c}, D={d}, V={v}")
        for label, fn, fl in rows:
            t_ms = ms(fn)
            rate = f"{fl / t_ms / 1e9:7.1f} TFLOP/s" if fl > 0 else \
                f"{-fl * p.numel() * 2 / t_ms / 1e6:7.1f} GB/s" if fl < 0 else ""
            print(f"{label:34s} {t_ms:8.3f} ms  {rate}")
        for label, fn, passes in (("stats", stored_stats, 1), ("dL/dz", stored_grad, 2)):
            print(f"launch-shape sweep of stored logits -> {label} (rows per program, warps), against HBM bandwidth:")
            for bm, nw in itertools.product((8, 16, 32, 64), (4, 8)):
                t_ms = ms(lambda: fn(block_m=bm, num_warps=nw))
                print(f"  BLOCK_M={bm:3d} num_warps={nw}  {t_ms:8.3f} ms  {passes * p.numel() * 2 / t_ms / 1e6:7.1f} GB/s")
        print("block-shape sweep of the fused GEMM (stats, the lean route's forward):")
        for (bm, bn_, bk, gm, nw, ns), tma in itertools.product(CONFIGS, (True, False)):
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn_, BLOCK_K=bk, GROUP_M=gm, num_warps=nw, num_stages=ns, TMA=tma)
            nt = triton.cdiv(v, bn_)
            tm, ts = torch.empty(c, nt, **f32), torch.empty(c, nt, **f32)
            try:
                t_ms = ms(lambda: stats(cfg))
                print(f"  {cfg}  {t_ms:8.3f} ms  {flop / t_ms / 1e9:7.1f} TFLOP/s")
            except Exception as e:  # noqa: BLE001 - report and go on (e.g. out of shared memory)
                print(f"  {cfg}  failed: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()
