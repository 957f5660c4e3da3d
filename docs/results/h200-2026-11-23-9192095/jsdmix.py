"""Session 9 microbench (not part of the package): the JSD mixture pass, four ways of forming p, q, s - log m and
u - log m; time per chunk and error of the JSD (mean and per-row) against float64."""
import sys, torch, triton, triton.language as tl
from triton.testing import do_bench

@triton.jit
def _lg(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1) * 0.6931471805599453
    return tl.log(x)

@triton.jit
def mix_kernel(Z, Y, CZ, CY, TILES, C, V, n_tiles, plane, beta, VAR: tl.constexpr, BLOCK_N: tl.constexpr):
    r0 = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    msk = rn < V
    z = tl.load(Z + r0.to(tl.int64) * V + rn, mask=msk, other=float("-inf")).to(tl.float32)
    y = tl.load(Y + r0.to(tl.int64) * V + rn, mask=msk, other=float("-inf")).to(tl.float32)
    s = z - tl.load(CZ + r0)
    u = y - tl.load(CY + r0)
    if VAR <= 1:
        p = tl.exp(s)
        q = tl.exp(u)
        log_m = _lg(tl.maximum(beta * q + (1.0 - beta) * p, 1.1754943508222875e-38), VAR == 1)
        s_m = s - log_m
        u_m = u - log_m
    elif VAR == 2:
        s_hi = s >= u
        h = tl.maximum(s, u, propagate_nan=tl.PropagateNan.ALL)
        a = tl.where(h == float("-inf"), float("-inf"), tl.minimum(s, u, propagate_nan=tl.PropagateNan.ALL) - h)
        e_h = tl.exp(h)
        r = tl.exp(a)
        e_l = e_h * r
        w_h = tl.where(s_hi, 1.0 - beta, beta)
        L = _lg(w_h + (1.0 - w_h) * r, True)
        p = tl.where(s_hi, e_h, e_l)
        q = tl.where(s_hi, e_l, e_h)
        s_m = tl.where(s_hi, -L, a - L)
        u_m = tl.where(s_hi, a - L, -L)
    else:  # VAR 3: d = u - s, a = -|d|
        d = u - s
        a = -tl.abs(d)
        r = tl.exp(a)
        u_hi = d > 0
        w_h = tl.where(u_hi, beta, 1.0 - beta)
        Lh = -_lg(w_h + (1.0 - w_h) * r, True)
        s_m = tl.where(u_hi, a + Lh, Lh)
        u_m = tl.where(u_hi, Lh, a + Lh)
        p = tl.exp(s)
        q = tl.exp(u)
    stat = r0.to(tl.int64) * n_tiles + pid_n
    tl.store(TILES + stat, tl.sum(tl.where(q == 0.0, 0.0, q * u_m)))
    tl.store(TILES + plane + stat, tl.sum(tl.where(p == 0.0, 0.0, p * s_m)))

def run(z, y, cz, cy, beta, var, bn=2048, warps=4):
    c, v = z.shape
    nt = triton.cdiv(v, bn)
    tiles = torch.empty(2, c, nt, device=z.device)
    mix_kernel[(c, nt)](z, y, cz, cy, tiles, c, v, nt, c * nt, beta, VAR=var, BLOCK_N=bn, num_warps=warps)
    return tiles

def main():
    torch.manual_seed(0)
    beta = 0.5
    for c, v in ((4096, 64128), (2048, 128256)):
        z = (torch.randn(c, v, device="cuda") * 2.5)
        z[:, :64] += 12 * torch.rand(c, 1, device="cuda")  # a few confident columns
        y = z + torch.randn(c, v, device="cuda") * 1.5
        z, y = z.bfloat16(), y.bfloat16()
        z64, y64 = z.double(), y.double()
        s64 = z64 - z64.logsumexp(1, keepdim=True); u64 = y64 - y64.logsumexp(1, keepdim=True)
        m64 = torch.logaddexp(s64 + torch.log(torch.tensor(1 - beta, dtype=torch.float64)), u64 + torch.log(torch.tensor(beta, dtype=torch.float64)))
        kq = (u64.exp() * (u64 - m64)).sum(1); kp = (s64.exp() * (s64 - m64)).sum(1)
        jsd64 = beta * kq + (1 - beta) * kp
        del s64, u64, m64
        cz = z.float().logsumexp(1).contiguous(); cy = y.float().logsumexp(1).contiguous()
        # fp32 torch-eager-style JSD for comparison
        zf, yf = z.float(), y.float()
        sf = torch.log_softmax(zf, 1); uf = torch.log_softmax(yf, 1)
        mf = torch.logsumexp(torch.stack([sf + torch.log(torch.tensor(1 - beta)).cuda(), uf + torch.log(torch.tensor(beta)).cuda()]), 0)
        jt = beta * (uf.exp() * (uf - mf)).sum(1) + (1 - beta) * (sf.exp() * (sf - mf)).sum(1)
        del sf, uf, mf, zf, yf
        e_t = ((jt.double().mean() - jsd64.mean()) / jsd64.mean()).abs().item()
        r_t = ((jt.double() - jsd64).abs() / jsd64.abs()).max().item()
        print(f"C={c} V={v} mean JSD {jsd64.mean().item():.5f}; torch fp32 eager: mean rel err {e_t:.2e}, max row rel err {r_t:.2e}")
        for var in (0, 1, 2, 3):
            t = run(z, y, cz, cy, beta, var).double().sum(2)
            j = beta * t[0] + (1 - beta) * t[1]
            e = ((j.mean() - jsd64.mean()) / jsd64.mean()).abs().item()
            r = ((j - jsd64).abs() / jsd64.abs()).max().item()
            ms = do_bench(lambda: run(z, y, cz, cy, beta, var), warmup=50, rep=300)
            print(f"  variant {var}: {ms:.3f} ms ({2 * z.numel() * 2 / ms / 1e9:.2f} TB/s), mean rel err {e:.2e}, max row rel err {r:.2e}")
        for bn, w in ((1024, 4), (4096, 8), (2048, 8)):
            ms = do_bench(lambda: run(z, y, cz, cy, beta, 3, bn, w), warmup=50, rep=300)
            print(f"  variant 3 at {bn} cols {w} warps: {ms:.3f} ms")
main()
