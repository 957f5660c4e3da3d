"""CPU check of the numerics of a scaled-exp P (twelfth session; the design note in docs/benchmarks.md, "What would
close it"): the statistics GEMM would store E = bf16(2^(z log2 e - k)) with k one integer per (row, 64-column
block) instead of the logits; after the exchange a small pass would write the target's entry and the strip
u = 2^(k - k_r) per (row, block), with v = s 2^(k_r) e^(-L) per row. The backward GEMMs would then form the
gradient G = v (u ⊙ E) as they load E. Against float64: is G as close as today's P, which holds
the exact gradient of the bf16-rounded logits, rounded once to bf16, entry by entry and through dX = G W? Confident
rows (p_t near 1), rows whose target sits in a block far below the row's max, and ignored tokens (s = 0)
included. (The scaled-exp E is taken from the fp32 accumulator, not from rounded logits: closer to float64.)

    python scaled_exp_check.py
"""
import torch

torch.manual_seed(0)
n, v, d, blk = 64, 1024, 48, 64
LOG2E = 1.4426950408889634
z = torch.randn(n, v, dtype=torch.float64) * 3
t = torch.randint(0, v, (n,))
z[:8, :] -= 20.0
z[torch.arange(8), t[:8]] += 40.0          # confident: p_t within 1e-8 of 1
z[8:12, :] += torch.linspace(0, 30, v, dtype=torch.float64)  # the max far from the target's block
t[8:12] = 3
s = torch.rand(n, dtype=torch.float64) / n
s[12:14] = 0.0                              # ignored tokens
z32 = z.float()                             # the GEMM's fp32 accumulator
w = torch.randn(v, d, dtype=torch.float64) / v ** 0.5

rows = torch.arange(n)


def gradient(zz):
    """s (softmax(zz) - onehot(t)) in float64, the target's entry -s q with q = 1 - p_t without cancellation."""
    lse = torch.logsumexp(zz, 1)
    g = s[:, None] * torch.softmax(zz, 1)
    qq = -torch.expm1(zz[rows, t] - lse)
    g[rows, t] = -s * qq
    return g, lse, qq


G_ref, L, q = gradient(z)
# today's P: the logits as the GEMM stores them (bf16), their exact gradient rounded once to bf16
G_today = gradient(z32.to(torch.bfloat16).double())[0].to(torch.bfloat16).double()
# the scaled-exp statistics come from the fp32 accumulator (its epilogue), as the fp32 target logit does today
L, q = torch.logsumexp(z32.double(), 1), -torch.expm1(z32.double()[rows, t] - torch.logsumexp(z32.double(), 1))

# the scaled-exp P: E rounded once to bf16 against a power of two per (row, block)
zb = z32.view(n, v // blk, blk).double()
k = torch.round(zb.amax(2) * LOG2E)                                    # [n, v/blk], integers
E = torch.exp2(zb * LOG2E - k[:, :, None]).to(torch.bfloat16).double()  # in (0, ~1.4]
k_r = k.amax(1)
u = torch.exp2(k - k_r[:, None]).to(torch.bfloat16).double()            # powers of two: exact (or 0 far below)
vrow = s * torch.exp2(k_r) * torch.exp(-L)
# the target's entry: -q s / (v u) in the same frame, rounded once
bt = t // blk
scale_t = vrow * u[torch.arange(n), bt]
fix = torch.where(scale_t > 0, -q * s / torch.where(scale_t > 0, scale_t, 1.0), 0.0).to(torch.bfloat16).double()
E = E.view(n, v).clone()
E[torch.arange(n), t] = fix
G_new = vrow[:, None] * (u[:, :, None] * E.view(n, v // blk, blk)).view(n, v)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def worst_entry(a, b):
    big = b.abs() > 1e-30
    return ((a - b).abs()[big] / b.abs()[big]).max().item()


print(f"G, whole:         today {rel(G_today, G_ref):.3e}   scaled-exp {rel(G_new, G_ref):.3e}")
print(f"G, worst entry:   today {worst_entry(G_today, G_ref):.3e}   scaled-exp {worst_entry(G_new, G_ref):.3e}")
tt = (torch.arange(n), t)
print(f"G, target entries: today {worst_entry(G_today[tt], G_ref[tt]):.3e}   "
      f"scaled-exp {worst_entry(G_new[tt], G_ref[tt]):.3e}")
print(f"confident rows, p_t - 1 = {(-q[:8]).max().item():.1e}; ignored rows zero: {bool((G_new[12:14] == 0).all())}")
dx_ref = G_ref @ w
print(f"dX = G W:         today {rel(G_today @ w, dx_ref):.3e}   scaled-exp {rel(G_new @ w, dx_ref):.3e}")
assert rel(G_new, G_ref) <= rel(G_today, G_ref)
assert worst_entry(G_new[tt], G_ref[tt]) <= worst_entry(G_today[tt], G_ref[tt])
