# dW of one chunk at tp=2 (Llama-3-8B shard: g [16384, 64128], x [16384, 4096]) over quack configs, and cuBLAS fp32
import time, torch, sys
from quack import gemm_interface as q
from quack.gemm_config import GemmConfig
torch.manual_seed(0)
n, v, d = 16384, int(sys.argv[1]) if len(sys.argv) > 1 else 64128, 4096
x = torch.randn(n, d, device="cuda").bfloat16()
g = (torch.randn(n, v, device="cuda") * 1e-4).softmax(-1).bfloat16()  # small positive, like p / N
g[torch.arange(n), torch.randint(0, v, (n,))] -= 1.0 / n
s = torch.ones(1, device="cuda")
out = torch.empty(v, d, device="cuda", dtype=torch.bfloat16)
def t(f, reps=8):
    f(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(reps): f()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps
print("cublas fp32", round(t(lambda: torch.mm(g.t(), x, out_dtype=torch.float32)), 3), flush=True)
cfgs = [(256, 192, 1, 2, False), (128, 256, 2, 1, False), (128, 256, 1, 2, False), (256, 128, 1, 2, False),
        (256, 128, 2, 1, False), (128, 192, 2, 1, True), (128, 256, 2, 1, True), (256, 192, 2, 1, False)]
for tm, tn, cm, cn, pp in cfgs:
    c = GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=pp, is_dynamic_persistent=False)
    try:
        t0 = time.time()
        ms = t(lambda: q.gemm_tuned.fn(g.t(), x, out, alpha=s, config=c))
        print(f"{tm}x{tn} c{cm}x{cn} {'pp' if pp else 'coop'}: {ms:.3f} ms (first {time.time() - t0:.0f} s)", flush=True)
    except Exception as e:
        print(f"{tm}x{tn} c{cm}x{cn} pp={pp}: failed {str(e)[:120]}", flush=True)
