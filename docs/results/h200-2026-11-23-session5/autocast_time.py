"""The autocast call (fp32 parameters under torch.autocast(bf16)) against the same call on bf16 tensors plus the
casts, Llama-3-8B head, one GPU (issue #20's acceptance: <= 1.03x)."""
import math, sys, torch
sys.path.insert(0, ".")
import triton
import vpce
N, D, V = 16384, 4096, 128256
g = torch.Generator(device="cuda").manual_seed(0)
h32 = torch.randn(N, D, device="cuda", generator=g).requires_grad_()
w32 = (torch.randn(V, D, device="cuda", generator=g) / math.sqrt(D)).requires_grad_()
t = torch.randint(0, V, (N,), device="cuda", generator=g)
h16 = h32.detach().bfloat16().requires_grad_()
w16 = w32.detach().bfloat16().requires_grad_()
ms = lambda fn: triton.testing.do_bench(fn, warmup=5, rep=2000, return_mode="median")
def bf16_call():
    h16.grad = w16.grad = None
    vpce.linear_cross_entropy(h16, w16, t).backward()
def autocast_call():
    h32.grad = w32.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = vpce.linear_cross_entropy(h32, w32, t)
    loss.backward()
gh, gw = torch.randn(N, D, device="cuda").bfloat16(), torch.randn(V, D, device="cuda").bfloat16()
def casts():  # what autocast adds: operands down to bf16, gradients back up to fp32
    h32.detach().bfloat16(); w32.detach().bfloat16(); gh.float(); gw.float()
a, b, c = ms(bf16_call), ms(autocast_call), ms(casts)
print(f"bf16 call {a:.2f} ms; autocast call {b:.2f} ms; casts alone {c:.2f} ms; autocast / (bf16 + casts) = {b / (a + c):.3f}")
with torch.autocast("cuda", dtype=torch.bfloat16):
    l32 = vpce.linear_cross_entropy(h32, w32, t)
l16 = vpce.linear_cross_entropy(h16, w16, t)
print(f"loss autocast {l32.item():.7f} vs bf16 operands {l16.item():.7f}; grads dtype {h32.grad.dtype if h32.grad is not None else None}")
