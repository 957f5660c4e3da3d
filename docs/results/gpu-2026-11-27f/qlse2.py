"""#36: the stats-epilogue branch's logits GEMM (gemm.logits_with_stats: quack's epilogue takes the LSE of the
rounded logits and selects the raw target logit; kernels.target_out_of_lse takes the target out) against cuBLAS's
logits + target_logits + the statistics pass, each followed by reduce_tiles + combine_rank_stats, on one chunk of
each bench head, plain and with a soft cap of 30, at several configs (gemm.LOGITS_TILE replaced per entry); quack's
lse_target_epi at the same configs as a reference. Checks: D's bits against cuBLAS's; the final LSE against the
statistics pass's and float64. $OUT/qlse2.json after each entry. Run with PYTHONPATH=<se tree>:<quack site>."""
import json, math, os, time, traceback
import torch
from vpce import gemm, kernels

OUT = os.path.join(os.environ.get("OUT", "/tmp"), "qlse2.json")
CONFIGS = [(128, 192, 2, 1, True), (128, 192, 1, 2, True), (128, 208, 2, 1, True), (256, 192, 1, 2, False),
           (256, 208, 2, 1, False)]
HEADS = [("llama-16384", 16384, 128256, 4096), ("gemma-8192", 8192, 256000, 2304)]


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


def main():
    from quack.gemm_config import GemmConfig
    try:
        from quack.epilogue.library import lse_target_epi
    except TypeError as e:
        print("quack.epilogue.library:", repr(e)[:120], flush=True)
        lse_target_epi = None
    out = {"device": torch.cuda.get_device_name(), "configs": CONFIGS}
    for name, c, v, d in HEADS:
        if os.environ.get("ONLY") and os.environ["ONLY"] not in name:
            continue
        torch.manual_seed(0)
        x = torch.randn(c, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * 0.02
        tgt = torch.randint(0, v, (c,), device="cuda")
        tgt[::7] = -1  # some ignored tokens
        tl = tgt.to(torch.int32)
        p = torch.empty(c, v, device="cuda", dtype=torch.bfloat16)
        torch.mm(x, w.t(), out=p)
        ref_p = p.clone()
        log(out, name, "cublas_ms", t(lambda: torch.mm(x, w.t(), out=p)))
        nt = math.ceil(v / kernels.tile_n(p))
        tm, ts = torch.empty(c, nt, device="cuda"), torch.empty(c, nt, device="cuda")
        zt, s1 = torch.empty(c, device="cuda"), torch.empty(c, 1, device="cuda")
        here = tgt >= 0
        rows = torch.arange(c, device="cuda")[here]
        for cap in (None, 30.0):
            tag = "cap" if cap else "plain"

            def base():
                torch.mm(x, w.t(), out=p)
                kernels.target_logits(x, w, None, tl, zt, softcap=cap)
                kernels.stored_logits(p, None, tl, softcap=cap, tile_m=tm, tile_s=ts)
                return kernels.combine_rank_stats(kernels.reduce_tiles(tm, ts, None, None, zt)[None], 0).lse
            log(out, name, f"{tag} cublas+stats_ms", t(base))
            ref = base().double()
            q = ref_p.double() if cap is None else 30 * torch.tanh(ref_p.double() / 30)
            exact = (x.double() * w[tgt.clamp(min=0)].double()).sum(1)
            q[rows, tgt[here]] = exact[here] if cap is None else 30 * torch.tanh(exact[here] / 30)
            lse64 = torch.logsumexp(q, 1)
            del q
            log(out, name, f"{tag} stats_vs_fp64", (ref - lse64).abs().max().item())

            def epi():
                lse, _ = gemm.logits_with_stats(p, x, w, tl, zt, cap)
                kernels.target_out_of_lse(lse, zt, s1.view(-1), p.dtype, softcap=cap)
                return kernels.combine_rank_stats(kernels.reduce_tiles(lse[:, None], s1, None, None, zt)[None], 0).lse
            for cfg_t in CONFIGS:
                key = "%s se %dx%d c%dx%d %s" % (tag, cfg_t[0], cfg_t[1], cfg_t[2], cfg_t[3], "pp" if cfg_t[4] else "coop")
                try:
                    gemm.LOGITS_TILE = dict(tile_m=cfg_t[0], tile_n=cfg_t[1], cluster_m=cfg_t[2], cluster_n=cfg_t[3],
                                            pingpong=cfg_t[4])
                    gemm._logits_config.cache_clear()
                    p.zero_()
                    t0 = time.perf_counter()
                    got = epi().double()
                    torch.cuda.synchronize()
                    r = {"compile_s": round(time.perf_counter() - t0, 1),
                         "D_equal": (p == ref_p).float().mean().item(),
                         "lse_vs_stats": (got - ref).abs().max().item(), "lse_vs_fp64": (got - lse64).abs().max().item()}
                    r["ms"] = t(epi)
                except Exception as e:  # noqa: BLE001
                    r = "failed: " + repr(e)[:300] + " | " + traceback.format_exc()[-600:]
                log(out, name, key, r)
            if cap is None and lse_target_epi is not None:
                for cfg_t in CONFIGS:
                    key = "lse_tgt %dx%d c%dx%d %s" % (cfg_t[0], cfg_t[1], cfg_t[2], cfg_t[3], "pp" if cfg_t[4] else "coop")
                    try:
                        cfg = GemmConfig(tile_m=cfg_t[0], tile_n=cfg_t[1], cluster_m=cfg_t[2], cluster_n=cfg_t[3],
                                         pingpong=cfg_t[4], is_dynamic_persistent=False)
                        r = t(lambda: lse_target_epi(x, w.t(), out={"D": p}, config=cfg, tuned=False, target=tgt))
                    except Exception as e:  # noqa: BLE001
                        r = "failed: " + repr(e)[:300]
                    log(out, name, key, r)
        del x, w, p, ref_p, tm, ts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
