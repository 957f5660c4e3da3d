"""Session 10 helper of sass_count.py: compile a vpce kernel for sm_90 with Triton 3.6 (no GPU)."""
import sys, collections, re
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "/work/main")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from vpce import kernels as K
def jitfn(k):
    while not isinstance(k, JITFunction): k = k.fn
    return k
ints = set("C V n_tiles plane stride_zm stride_ym stride_gm".split())
fl = set("softcap t_softcap inv_t beta".split())
ONE = {"stride_ln"}
def sig_is_ptr(n): return n[0].isupper() and n not in ("C", "V", "M", "T", "D", "W", "R")
def comp(kernel, meta, bf=("Z", "Y", "G")):
    fn = jitfn(kernel); sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        n = p.name
        if p.is_constexpr: sig[n] = "constexpr"; consts[n] = meta[n]; continue
        if n in ONE: sig[n] = "constexpr"; consts[n] = 1; continue
        if False: attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ints: sig[n] = "i32"
        elif n in fl: sig[n] = "fp32"
        elif n in bf: sig[n] = "*bf16"
        elif n == "TL": sig[n] = "*i32"
        else: sig[n] = "*fp32"
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
    return c
base = dict(SOFTCAP=False, T_SOFTCAP=False, TEMPERATURE=False, BLOCK_M=1, BLOCK_N=2048, EVEN_N=True)
for name, k, meta in [("stats-kl0", K._distill_stats_kernel, dict(base, KL=0, CE=False, CE_AT=4)),
                      ("stats-fkl", K._distill_stats_kernel, dict(base, KL=1, CE=False, CE_AT=5)),
                      ("mixture", K._distill_mixture_kernel, dict(base, FAST_LOG=True)),
                      ("grad-jsd", K._distill_grad_kernel, dict({k: v for k, v in base.items() if k != "EVEN_N"}, KIND=2, CE=False, FAST_LOG=True)),
                      ("grad-fkl", K._distill_grad_kernel, dict({k: v for k, v in base.items() if k != "EVEN_N"}, KIND=0, CE=False, FAST_LOG=True))]:
    c = comp(k, meta)
    sass = c.asm.get("sass") 
    ptx = [l.strip() for l in c.asm["ptx"].splitlines() if l.strip() and not l.strip().startswith(("//", ".", "$", "{", "}"))]
    ops = collections.Counter(l.split()[0].split(".")[0].lstrip("@%p0123456789 ") for l in ptx)
    print(name, "ptx instr", len(ptx), dict(ops.most_common(14)))
