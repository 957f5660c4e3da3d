"""Session 12 (#17): can a logits GEMM drop the tensor cores' accumulation shrink at cuBLAS's rate? A Triton GEMM
``A @ B^T`` (fp32 out) whose partial sums over ``P`` K-blocks are added into a second fp32 accumulator with the
CUDA cores' round-to-nearest (P = 0: one accumulator, as cuBLAS); its shrink against float64 and its time beside
cuBLAS on the distillation's chunk shapes (3072 tokens, V = 128256, K = 4096 student / 8192 teacher)."""
import sys
import torch
import triton
import triton.language as tl


@triton.jit
def _gemm(A, B, C, M, N, K, one, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr,
          GROUP: tl.constexpr):
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP * n_n
    g = pid // width
    first = g * GROUP
    size = tl.minimum(n_m - first, GROUP)
    pm = first + (pid % width) % size
    pn = (pid % width) // size
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_p = A + rm.to(tl.int64)[:, None] * K + rk[None, :]
    b_p = B + rn.to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if P == 0:
        for k in range(0, K, BK):
            a = tl.load(a_p, mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_p, mask=rn[:, None] < N, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            a_p += BK
            b_p += BK
    else:  # one load per iteration (the pipeliner's shape); every P-th iteration folds the partial sum in
        part = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = tl.load(a_p, mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_p, mask=rn[:, None] < N, other=0.0)
            part = tl.dot(a, tl.trans(b), part)
            if (k // BK) % P == P - 1:
                acc = tl.fma(part, one, acc)  # a runtime 1.0: not folded back into the MMA's accumulator
                part = tl.zeros((BM, BN), dtype=tl.float32)
            a_p += BK
            b_p += BK
        acc = tl.fma(part, one, acc)
    c_p = C + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(c_p, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm(a, b, p, bm, bn, bk, warps, stages):
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm[grid](a, b, c, m, n, k, 1.0, BM=bm, BN=bn, BK=bk, P=p, GROUP=8, num_warps=warps, num_stages=stages)
    return c


def bench(fn, reps=20):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "compile":  # CPU: compile for sm_90 only
        from triton.backends.compiler import GPUTarget
        for p in (0, 2, 4):
            for bm, bn, bk, w, s in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4)):
                src = triton.compiler.ASTSource(fn=_gemm, signature={"A": "*bf16", "B": "*bf16", "C": "*fp32",
                    "M": "i32", "N": "i32", "K": "i32", "one": "fp32", "BM": "constexpr", "BN": "constexpr",
                    "BK": "constexpr", "P": "constexpr", "GROUP": "constexpr"},
                    constexprs={"BM": bm, "BN": bn, "BK": bk, "P": p, "GROUP": 8})
                k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": w, "num_stages": s})
                print(p, bm, bn, "regs/spills", k.n_regs if hasattr(k, "n_regs") else "?", k.metadata.shared)
        return
    torch.manual_seed(0)
    dev = "cuda"
    m, n = 3072, 128256
    for kdim in (4096, 8192):
        a = torch.randn(m, kdim, device=dev).bfloat16()
        b = (torch.randn(n, kdim, device=dev) / kdim ** 0.5).bfloat16()
        ex = a[:512].double() @ b.double().T
        slope = lambda c: ((c[:512].double() * ex).sum() / (ex * ex).sum()).item() - 1  # noqa: E731
        flops = 2 * m * n * kdim
        t = bench(lambda: torch.mm(a, b.T))
        t32 = bench(lambda: torch.mm(a, b.T, out_dtype=torch.float32))
        print(f"K={kdim}: cuBLAS bf16 out {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s); fp32 out {t32:.3f} ms, "
              f"shrink {slope(torch.mm(a, b.T, out_dtype=torch.float32)):+.2e}", flush=True)
        for p in (0, 2, 4, 16):
            for cfg in ((128, 256, 64, 8, 3), (128, 256, 64, 8, 2), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4)):
                try:
                    c = gemm(a, b, p, *cfg)
                    tt = bench(lambda: gemm(a, b, p, *cfg))
                    print(f"  P={p} {cfg}: {tt:.3f} ms ({flops / tt / 1e9:.0f} TFLOP/s, {t32 / tt:.2f} of cuBLAS fp32 "
                          f"out), shrink {slope(c):+.2e}", flush=True)
                except Exception as ex_:  # a config out of registers or shared memory
                    print(f"  P={p} {cfg}: failed {type(ex_).__name__}: {str(ex_)[:120]}", flush=True)
        del a, b, ex


main()
