"""Session 11 microbench (not part of the package): the JSD mixture pass as the package runs it (one 1 x BLOCK_N
tile per program) against a looped form (each program walks TPP tiles of a row, accumulating the two sums per
column and reducing once). Times per 4096 x 64128 bf16 chunk; checks the sums against the package's."""
import sys
import torch, triton, triton.language as tl
from triton.testing import do_bench
from vpce import kernels as K


@triton.jit
def mix_loop(Z, Y, RM_Z, RLS_Z, RM_Y, RLS_Y, OUT, C, V, n_prog, stride_zm, stride_ym, beta,
             TPP: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0)
    pid = tl.program_id(1)
    rm = r + tl.arange(0, 1)
    row_ok = rm < C
    acc_q = tl.zeros([1, BLOCK_N], tl.float32)
    acc_p = tl.zeros([1, BLOCK_N], tl.float32)
    mz = tl.load(RM_Z + rm)[:, None]
    lz = (tl.load(RLS_Z + rm) * K.LOG2E)[:, None]
    my = tl.load(RM_Y + rm)[:, None]
    ly = (tl.load(RLS_Y + rm) * K.LOG2E)[:, None]
    for t in tl.range(0, TPP):
        rn = (pid * TPP + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (rn < V)[None, :]
        x = tl.load(Z + rm.to(tl.int64)[:, None] * stride_zm + rn[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.load(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        s = tl.fma(x - mz, K.LOG2E, -lz)
        u = tl.fma(y - my, K.LOG2E, -ly)
        p, q, s_m, u_m = K._jsd_terms(s, u, beta, True, True)
        acc_q += q * u_m
        acc_p += p * s_m
    o = rm.to(tl.int64) * n_prog + pid
    tl.store(OUT + o, tl.sum(acc_q, axis=1) * K.LN2, mask=row_ok)
    tl.store(OUT + C * n_prog + o, tl.sum(acc_p, axis=1) * K.LN2, mask=row_ok)


def looped(z, y, st, beta, tpp, bn, warps):
    c, v = z.shape
    n_prog = triton.cdiv(v, tpp * bn)
    out = torch.empty(2, c, n_prog, device=z.device)
    mix_loop[(c, n_prog)](z, y, *st, out, c, v, n_prog, z.stride(0), y.stride(0), beta, TPP=tpp, BLOCK_N=bn,
                          num_warps=warps)
    return out.sum(2)


def main():
    torch.manual_seed(0)
    c, v, beta = 4096, 64128, 0.5
    z = (torch.randn(c, v, device="cuda") * 2.5)
    y = (z + torch.randn(c, v, device="cuda") * 1.5).bfloat16()
    z = z.bfloat16()
    zf, yf = z.float(), y.float()
    st = (zf.amax(1), (zf - zf.amax(1, keepdim=True)).exp().sum(1).log(), yf.amax(1),
          (yf - yf.amax(1, keepdim=True)).exp().sum(1).log())
    del zf, yf
    opts = dict(beta=beta, softcap=None, t_softcap=None, inv_t=1.0)
    ref = K.distill_mixture(z, y, *st, **opts)
    gb = 2 * z.numel() * 2 / 1e9
    ms = do_bench(lambda: K.distill_mixture(z, y, *st, **opts), warmup=50, rep=300)
    print(f"package            {ms*1e3:8.1f} us  {gb/ms:6.2f} TB/s")
    for bn, warps, tpp in [(2048, 4, 1), (2048, 4, 2), (2048, 4, 4), (2048, 8, 4), (1024, 4, 4), (1024, 4, 8),
                           (2048, 4, 8), (4096, 8, 2), (1024, 2, 8), (512, 4, 8), (4096, 8, 4)]:
        try:
            got = looped(z, y, st, beta, tpp, bn, warps)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            ms = do_bench(lambda: looped(z, y, st, beta, tpp, bn, warps), warmup=50, rep=300)
            print(f"loop bn={bn:5d} w={warps} tpp={tpp}  {ms*1e3:8.1f} us  {gb/ms:6.2f} TB/s  rel.err {err:.1e}")
        except Exception as e:  # noqa: BLE001
            print(f"loop bn={bn} w={warps} tpp={tpp}: {type(e).__name__}: {str(e)[:200]}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
