"""kernels.one_pass against the two passes it replaces (stored_logits stats + reduce_tiles + combine + the host's
coefficients + stored_logits grad) on one chunk of stored bf16 logits: Llama-3-8B (8192 x 128256) and Gemma-2-2B
(8192 x 256000), plain and soft cap, at a few launch shapes. $OUT/opbench.txt. Run with PYTHONPATH=<tree>."""
import math, os, torch
from vpce import formulas, kernels
from vpce.options import LossOptions

OUT = os.path.join(os.environ.get("OUT", "/tmp"), "opbench.txt")
SMOKE = os.environ.get("SMOKE") == "1"  # CPU interpreter, tiny shapes: the script's own check
DEV = "cpu" if SMOKE else "cuda"


def log(*a):
    print(*a, flush=True)
    with open(OUT, "a") as f:
        print(*a, file=f)


def t(fn, reps=10):
    fn()
    if SMOKE:
        return 0.0
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


log(DEV if SMOKE else torch.cuda.get_device_name())
for name, c, v in ((("smoke", 8, 203),) if SMOKE else (("llama", 8192, 128256), ("gemma", 8192, 256000))):
    torch.manual_seed(0)
    z0 = (torch.randn(c, v, device=DEV) * 2).to(torch.float32 if SMOKE else torch.bfloat16)
    t_ = torch.randint(0, v, (c,), device=DEV, dtype=torch.int32)
    zbuf = torch.empty_like(z0)
    for cap in (None, 30.0):
        o = LossOptions(softcap=cap)
        scale = torch.ones(c, device=DEV)
        zt = z0.float()[torch.arange(c, device=DEV), t_.long()]
        if cap:
            zt = cap * torch.tanh(zt / cap)
        bn = kernels.tile_n(z0)
        nt = math.ceil(v / bn)
        tm, ts = torch.empty(c, nt, device=DEV), torch.empty(c, nt, device=DEV)

        def two():
            kernels.stored_logits(zbuf, None, t_, softcap=cap, tile_m=tm, tile_s=ts)
            st = kernels.combine_rank_stats(kernels.reduce_tiles(tm, ts, None, None, zt)[None], 0)
            co = formulas.ce_coefficients(scale, st.lse, o, v)
            kernels.stored_logits(zbuf, None, t_, softcap=cap, rows=(st.m, st.lse, st.q), coef=co)

        aff = formulas.ce_affine_coefficients(scale, o, v)
        ms2 = t(lambda: (zbuf.copy_(z0), two()))
        ms_copy = t(lambda: zbuf.copy_(z0))
        log(f"{name} cap={cap}: two passes {ms2 - ms_copy:.3f} ms (copy {ms_copy:.3f} subtracted)")
        zbuf.copy_(z0); two()
        ref = zbuf.clone()
        for bn1, bm, warps in (((32, 2, 4),) if SMOKE else ((8192, 1, 8), (4096, 1, 8), (8192, 1, 16), (4096, 2, 8),
                                                             (4096, 1, 4), (16384, 1, 16), (2048, 4, 8))):
            try:
                run = lambda: kernels.one_pass(zbuf, t_, zt, aff, softcap=cap, block_n=bn1, block_m=bm,  # noqa
                                              num_warps=warps)
                zbuf.copy_(z0); run()
                err = ((zbuf.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                ms1 = t(lambda: (zbuf.copy_(z0), run()))
                log(f"  one pass BLOCK_N {bn1} BLOCK_M {bm} warps {warps}: {ms1 - ms_copy:.3f} ms, grad max rel diff {err:.1e}")
            except Exception as e:  # noqa: BLE001
                log(f"  one pass BLOCK_N {bn1} BLOCK_M {bm} warps {warps}: failed {e!r}"[:300])
    del z0, zbuf
    if not SMOKE:
        torch.cuda.empty_cache()
