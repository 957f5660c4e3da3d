"""stored_logits launch shapes (rows, columns, warps): statistics (plain and with the metrics' sums), gradient."""
import math, sys, torch, triton
sys.path.insert(0, ".")
from vpce import kernels
ms = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
CFGS = [(16, 256, 4), (16, 256, 8), (8, 256, 4), (8, 256, 8), (16, 128, 4), (32, 256, 8), (32, 128, 4), (2, 2048, 4)]
for name, d, v in (("llama3-8b", 4096, 128256), ("gemma2-2b", 2304, 256000)):
    c = 4096
    x = torch.randn(c, d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(v, d, device="cuda") / math.sqrt(d)).to(torch.bfloat16)
    t = torch.randint(0, v, (c,), device="cuda", dtype=torch.int32)
    p = torch.mm(x, w.t())
    p0 = p.clone()
    f32 = dict(device="cuda", dtype=torch.float32)
    rows_ = (torch.zeros(c, **f32), torch.full((c,), 12.0, **f32), torch.full((c,), 0.5, **f32))
    scale = torch.full((c,), 1e-4, **f32)
    coef = (scale, None, -scale, None)
    gb = p.numel() * 2 / 1e9
    print(f"## {name}: C={c} V={v}, {gb:.2f} GB of bf16 logits", flush=True)
    for bm, bn, nw in CFGS:
        nt = triton.cdiv(v, bn)
        tm, ts, tz, tez, tsq, tmb = (torch.empty(c, nt, **f32) for _ in range(6))
        zt = torch.zeros(c, **f32)
        out = []
        for label, kw, passes in (
            ("stats", dict(tile_m=tm, tile_s=ts, zt=zt), 1),
            ("stats+acc+ent", dict(tile_m=tm, tile_s=ts, zt=zt, tile_ez=tez, tile_mb=tmb, before=t), 1),
            ("stats+ent", dict(tile_m=tm, tile_s=ts, zt=zt, tile_ez=tez), 1),
            ("stats+acc", dict(tile_m=tm, tile_s=ts, zt=zt, tile_mb=tmb, before=t), 1),
            ("stats+all3", dict(tile_m=tm, tile_s=ts, zt=zt, tile_ez=tez, tile_sq=tsq, tile_mb=tmb, before=t), 1),
        ):
            fn = lambda: kernels.stored_logits(p, None, t, block_n=bn, block_m=bm, num_warps=nw, **kw)
            try:
                t_ms = ms(fn)
                out.append(f"{label} {t_ms:6.3f} ms {passes * gb / t_ms:4.2f} TB/s")
            except Exception as e:  # noqa: BLE001
                out.append(f"{label} failed {type(e).__name__}: {str(e)[:80]}")
            p.copy_(p0)
        print(f"  ({bm:2d},{bn:5d},{nw}) " + " | ".join(out), flush=True)
    del p, p0, x, w
    torch.cuda.empty_cache()
