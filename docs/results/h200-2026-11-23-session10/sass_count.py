"""Session 10 (CPU, no GPU): SASS instruction counts of the bandwidth kernels compiled for sm_90 with Triton 3.6
(nvdisasm from its wheel). Usage: python sass_count.py REPO_ROOT (the checkout whose vpce to compile)."""
import sys, collections, subprocess, tempfile, os
root = sys.argv[1]
sys.argv = [sys.argv[0], root]
exec(open(__file__.replace("sass_count.py", "sass_compile.py")).read().split("base = dict")[0])
B = "/tmp/w/t36/lib/python3.11/site-packages/triton/backends/nvidia/bin/"
base = dict(SOFTCAP=False, T_SOFTCAP=False, TEMPERATURE=False, BLOCK_M=1, BLOCK_N=2048, EVEN_N=True)
nb = {k: v for k, v in base.items() if k != "EVEN_N"}
for name, k, meta in [("stats-kl0", K._distill_stats_kernel, dict(base, KL=0, CE=False, CE_AT=4)),
                      ("stats-fkl", K._distill_stats_kernel, dict(base, KL=1, CE=False, CE_AT=5)),
                      ("mixture", K._distill_mixture_kernel, dict(base, FAST_LOG=True)),
                      ("grad-jsd", K._distill_grad_kernel, dict(nb, KIND=2, CE=False, FAST_LOG=True)),
                      ("grad-fkl", K._distill_grad_kernel, dict(nb, KIND=0, CE=False, FAST_LOG=True))]:
    c = comp(k, meta)
    f = tempfile.mktemp(suffix=".cubin"); open(f, "wb").write(c.asm["cubin"])
    out = subprocess.run([B + "nvdisasm", "-c", f], capture_output=True, text=True).stdout
    ins = [l for l in out.splitlines() if "/*" in l and ";" in l]
    ops = collections.Counter(l.split("*/")[1].strip().split()[0].split(".")[0] if not l.split("*/")[1].strip().startswith("@") else l.split("*/")[1].strip().split()[1].split(".")[0] for l in ins)
    print(f"{name}: SASS {len(ins)}", dict(ops.most_common(16)))
meta = dict(HAS_BIAS=False, SOFTCAP=False, TEMPERATURE=False, GRAD=False, SUM_Z=False, SUM_EZ=False, HAS_CB=False, HAS_CD=False, HAS_CW=False, BLOCK_M=16, BLOCK_N=256, EVEN_N=True, SUM_SQ=False, TOP1=False)
ints.update({"M", "stride_lm", "stride_ln"})
for name, m in [("stored-stats", meta), ("stored-grad", dict(meta, GRAD=True)), ("stored-stats-cap", dict(meta, SOFTCAP=True)), ("stored-grad-cap", dict(meta, GRAD=True, SOFTCAP=True))]:
    c = comp(K._stored_logits_kernel, m, bf=("L",))
    f = tempfile.mktemp(suffix=".cubin"); open(f, "wb").write(c.asm["cubin"])
    out = subprocess.run([B + "nvdisasm", "-c", f], capture_output=True, text=True).stdout
    ins = [l for l in out.splitlines() if "/*" in l and ";" in l]
    ops = collections.Counter(l.split("*/")[1].strip().split()[0].split(".")[0] if not l.split("*/")[1].strip().startswith("@") else l.split("*/")[1].strip().split()[1].split(".")[0] for l in ins)
    print(f"{name}: SASS {len(ins)}", dict(ops.most_common(12)))
