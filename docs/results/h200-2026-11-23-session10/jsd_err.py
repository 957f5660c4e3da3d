"""Session 10: distillation loss errors against float64 over several seeds (one GPU): vpce (Triton fast route),
torch eager (bf16 logits, fp32 math: the bench's row) and float64 math on the same bf16 logits (the logits'
rounding alone). N=4096, D=4096, D_T=8192, V=128256, bf16."""
import math, sys, torch
sys.path.insert(0, ".")
import vpce
from vpce.reference import chunked_reference_distillation
from vpce.bench.peers import divergence_per_token
dev, bf = "cuda", torch.bfloat16
n, d, dt, v = 4096, 4096, 8192, 128256
rows = {}
for seed in range(6):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, d, device=dev, generator=g).to(bf)
    w = (torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)).to(bf)
    xt = torch.randn(n, dt, device=dev, generator=g).to(bf)
    wt = (torch.randn(v, dt, device=dev, generator=g) / math.sqrt(dt)).to(bf)
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    for div, beta in (("forward_kl", None), ("jsd", 0.5)):
        ref = chunked_reference_distillation(x, w, xt, wt, divergence=div, beta=beta).loss.item()
        xg = x.clone().requires_grad_()
        lv = vpce.linear_distillation_loss(xg, w, xt, wt, y, divergence=div, beta=beta).item()
        with torch.no_grad():
            zs, zt = (x @ w.T), (xt @ wt.T)
            lt = divergence_per_token(torch.log_softmax(zs.float(), -1), torch.log_softmax(zt.float(), -1), div, beta).mean().item()
            l64 = divergence_per_token(torch.log_softmax(zs.double(), -1), torch.log_softmax(zt.double(), -1), div, beta).mean().item()
            del zs, zt
        e = lambda a: (a - ref) / abs(ref)  # noqa: E731
        rows.setdefault(div, []).append((e(lv), e(lt), e(l64)))
        print(f"seed {seed} {div}: ref {ref:.7f}  signed rel err: vpce {e(lv):+.2e}  torch eager {e(lt):+.2e}  "
              f"fp64 on bf16 logits {e(l64):+.2e}", flush=True)
for div, r in rows.items():
    a = [abs(t[0]) for t in r]; b = [abs(t[1]) for t in r]
    print(f"{div}: mean |err| vpce {sum(a)/len(a):.2e}, torch eager {sum(b)/len(b):.2e}; vpce <= torch on {sum(x <= y for x, y in zip(a, b))} of {len(a)} seeds")
