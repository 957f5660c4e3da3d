"""#36, next step: the statistics pass folded into the logits GEMM's epilogue (quack 0.6.5's epilogue DSL), against
cuBLAS's logits + vpce's statistics pass, on one chunk of each bench head. Per head:
  cublas      P = x @ w.T (bf16), torch.mm
  stats       vpce's statistics pass over P: kernels.stored_logits (stats mode) + reduce_tiles + combine_rank_stats
  lse_epi     quack.epilogue.library.lse_epi: D = logits, online LSE partials of the fp32 accumulator, at pinned configs
  lse_tgt     quack.epilogue.library.lse_target_epi: the same + the fp32 target logit
  vpce_epi    vpce's statistics as an epilogue (vpce_stats_epi): the LSE of the logits as D holds them, the target
              column left out, and the fp32 target logit; the combine adds it back (logaddexp)
Checks: D's bits against cuBLAS's (fraction equal, max rel diff); each LSE against vpce's from P.
$OUT/qlse.json after each entry; ONLY=<head> for one head. Run with PYTHONPATH=<vpce tree>:<quack site>."""
import json, math, os, time, traceback
import torch
from vpce import kernels

OUT = os.path.join(os.environ.get("OUT", "/tmp"), "qlse.json")
CONFIGS = [  # tile_m, tile_n, cluster_m, cluster_n, pingpong (the logits GEMM's fastest in qgemm.py first)
    (256, 208, 2, 1, False), (256, 192, 1, 2, False), (128, 256, 2, 1, False), (128, 192, 2, 1, True)]
HEADS = [("llama-16384", 16384, 128256, 4096), ("gemma-8192", 8192, 256000, 2304), ("llama-8192", 8192, 128256, 4096)]


def t(fn, reps=8):
    for _ in range(2):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def log(out, name, key, val):
    out.setdefault(name, {})[key] = val
    print(name, key, val, flush=True)
    json.dump(out, open(OUT, "w"), indent=1)


if os.environ.get("LOCAL") == "1":  # compile checks on a machine without a GPU (CUTE_DSL_ARCH=sm_90a)
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    import quack.gemm_runtime.host as _host
    _host.get_max_active_clusters = lambda n, *a, **k: 132 // n

from cutlass import BFloat16, Float32  # noqa: E402
from quack.epilogue.frontend import gemm_epilogue  # noqa: E402
from quack.epilogue.math import pexp2  # noqa: E402
from quack.epilogue.ops import ColVecLoad, ColVecSelect, OnlineLSEReduce, RowVecLoad  # noqa: E402

_target = ColVecLoad("target")


@gemm_epilogue(ops={"tgtf": ColVecLoad("tgtf"), "col": RowVecLoad("col")},
               outs={"lse": OnlineLSEReduce("lse"), "target_logit": ColVecSelect("target_logit", idx_op=_target)},
               extra_ops=(_target,))
def vpce_stats_epi(acc, tgtf, col):
    """vpce's statistics pass as the logits GEMM's epilogue. D: the logits. lse: online LSE partials of the logits
    as D holds them (bf16-rounded), the target column left out (pushed to -1e30), as the statistics pass leaves it
    out. target_logit: the fp32 accumulator at the target column (the exact target logit the combine adds)."""
    z = acc.to(BFloat16).to(Float32)
    hit = Float32(col == tgtf)
    return {"D": acc, "lse": z - hit * Float32(1e30), "target_logit": acc}


@gemm_epilogue(ops={"tgtf": ColVecLoad("tgtf"), "col": RowVecLoad("col")},
               outs={"lse": OnlineLSEReduce("lse"), "target_logit": ColVecSelect("target_logit", idx_op=_target)},
               extra_ops=(_target,))
def vpce_cap_stats_epi(acc, tgtf, col):
    """``vpce_stats_epi`` with a soft cap of 30 (Gemma-2's): the LSE of 30 tanh(z / 30) of the rounded logits, in
    the exp2 form (30 - 60 / (1 + 2^(z 2 log2(e) / 30))); the target logit raw (the combine caps it)."""
    z = acc.to(BFloat16).to(Float32)
    s = Float32(30.0) - Float32(60.0) / (Float32(1.0) + pexp2(z * Float32(2 * 1.4426950408889634 / 30)))
    hit = Float32(col == tgtf)
    return {"D": acc, "lse": s - hit * Float32(1e30), "target_logit": acc}


def vpce_operands(tgt, v):
    return {"target": tgt, "tgtf": tgt.float(), "col": torch.arange(v, dtype=torch.float32, device=tgt.device)}


def local_check():
    """Compile (plan, no launch) each epilogue at each config on small CPU tensors."""
    from quack.gemm_config import GemmConfig
    try:  # (this machine's Python 3.12.1 refuses the library's fingerprints; the GPU image's imports it)
        from quack.epilogue.library import lse_epi, lse_target_epi
    except TypeError as e:
        print("quack.epilogue.library:", repr(e)[:120])
        lse_epi = lse_target_epi = None
    c, v, d = 256, 1000, 256
    x, w = torch.randn(c, d, dtype=torch.bfloat16), torch.randn(v, d, dtype=torch.bfloat16)
    p, tgt = torch.empty(c, v, dtype=torch.bfloat16), torch.randint(0, v, (c,))
    for label, epi, ops in (("lse_epi", lse_epi, {}), ("lse_tgt", lse_target_epi, {"target": tgt}),
                            ("vpce_epi", vpce_stats_epi, vpce_operands(tgt, v)),
                            ("vpce_cap_epi", vpce_cap_stats_epi, vpce_operands(tgt, v))):
        for cfg_t in CONFIGS if epi is not None else ():
            cfg = GemmConfig(tile_m=cfg_t[0], tile_n=cfg_t[1], cluster_m=cfg_t[2], cluster_n=cfg_t[3],
                             pingpong=cfg_t[4], is_dynamic_persistent=False)
            outs = {"D": p, "lse": torch.empty(c, math.ceil(v / cfg_t[1]))}
            if ops:
                outs["target_logit"] = torch.empty(c)
            try:
                epi.plan(x, w.t(), out=outs, config=cfg, **ops)
                print(label, cfg_t, "compiled", flush=True)
            except Exception as e:  # noqa: BLE001
                print(label, cfg_t, "failed", repr(e)[:300], flush=True)


def main():
    from quack.gemm_config import GemmConfig
    try:
        from quack.epilogue.library import lse_epi, lse_target_epi
    except TypeError as e:  # then vpce's own epilogue alone
        print("quack.epilogue.library:", repr(e)[:120], flush=True)
        lse_epi = lse_target_epi = None
    out = {"device": torch.cuda.get_device_name(), "configs": CONFIGS}
    for name, c, v, d in HEADS:
        if os.environ.get("ONLY") and os.environ["ONLY"] not in name:
            continue
        torch.manual_seed(0)
        x = torch.randn(c, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * 0.02
        tgt = torch.randint(0, v, (c,), device="cuda")
        p = torch.empty(c, v, device="cuda", dtype=torch.bfloat16)
        log(out, name, "cublas_ms", t(lambda: torch.mm(x, w.t(), out=p)))
        torch.mm(x, w.t(), out=p)
        ref_p = p.clone()
        # vpce's statistics pass over P (the target column left out, its fp32 logit added by the combine)
        bn = kernels.tile_n(p)
        nt = math.ceil(v / bn)
        tm, ts = torch.empty(c, nt, device="cuda"), torch.empty(c, nt, device="cuda")
        zt = (x.float() * w[tgt].float()).sum(1)  # the target logit in fp32, as vpce's target_logits gives it
        tl = tgt.to(torch.int32)

        def stats():
            kernels.stored_logits(p, None, tl, tile_m=tm, tile_s=ts)
            return kernels.combine_rank_stats(kernels.reduce_tiles(tm, ts, None, None, zt)[None], 0)
        log(out, name, "stats_ms", t(stats))
        lse_ref = stats().lse.double()
        p64 = p.double()
        p64[torch.arange(c, device="cuda"), tgt] = zt.double()  # what vpce's statistics mean: P's other logits
        lse64 = torch.logsumexp(p64, 1)
        del p64
        log(out, name, "stats_lse_vs_fp64", (lse_ref - lse64).abs().max().item())
        cap64 = None  # the soft-capped float64 LSE, made once per head where the capped epilogue runs
        runs = [("vpce_epi", vpce_stats_epi, vpce_operands(tgt, v)),
                ("vpce_cap_epi", vpce_cap_stats_epi, vpce_operands(tgt, v)),
                ("lse_tgt", lse_target_epi, {"target": tgt}), ("lse_epi", lse_epi, {})]
        for label, epi, ops in runs:
            for cfg_t in CONFIGS if epi is not None else ():
                key = "%s %dx%d c%dx%d %s" % (label, cfg_t[0], cfg_t[1], cfg_t[2], cfg_t[3], "pp" if cfg_t[4] else "coop")
                try:
                    cfg = GemmConfig(tile_m=cfg_t[0], tile_n=cfg_t[1], cluster_m=cfg_t[2], cluster_n=cfg_t[3],
                                     pingpong=cfg_t[4], is_dynamic_persistent=False)
                    t0 = time.perf_counter()
                    res = epi(x, w.t(), out={"D": p}, config=cfg, tuned=False, **ops)
                    torch.cuda.synchronize()
                    compile_s = time.perf_counter() - t0
                    same = (p == ref_p).float().mean().item()
                    rel = ((p.float() - ref_p.float()).abs().max() / ref_p.float().abs().max()).item()
                    lse = res["lse"].double().reshape(-1)
                    if label == "vpce_epi":  # the target column was left out: the combine adds its fp32 logit
                        lse = torch.logaddexp(lse, res["target_logit"].double().reshape(-1))
                    ref64, ref_vpce = lse64, lse_ref
                    if label == "vpce_cap_epi":  # the soft-capped LSE, against float64 of cuBLAS's P capped
                        lse = torch.logaddexp(lse, 30 * torch.tanh(res["target_logit"].double().reshape(-1) / 30))
                        if cap64 is None:
                            q = 30 * torch.tanh(ref_p.double() / 30)
                            q[torch.arange(c, device="cuda"), tgt] = 30 * torch.tanh(zt.double() / 30)
                            cap64 = torch.logsumexp(q, 1)
                            del q
                        ref64 = ref_vpce = cap64
                    r = {"ms": t(lambda: epi(x, w.t(), out={"D": p}, config=cfg, tuned=False, **ops)),
                         "compile_s": round(compile_s, 1), "D_equal_to_cublas": same, "D_max_rel_diff": rel,
                         "lse_vs_vpce": (lse - ref_vpce).abs().max().item(),
                         "lse_vs_fp64": (lse - ref64).abs().max().item()}
                    if "target_logit" in res:
                        r["target_vs_fp32_dot"] = (res["target_logit"].double().reshape(-1) - zt.double()).abs().max().item()
                except Exception as e:  # noqa: BLE001
                    r = "failed: " + repr(e)[:300] + " | " + traceback.format_exc()[-600:]
                log(out, name, key, r)
        del x, w, p, ref_p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    local_check() if os.environ.get("LOCAL") == "1" else main()
