"""#36: the gradient pass alone (``kernels.stored_logits`` in grad mode, in place over one whole chunk's P) on the
bench heads, per option set and launch shape, for the tree on PYTHONPATH. P holds the real bf16 logits of random
inputs (cuBLAS), then its own gradients after the first pass (the pass's cost does not depend on the values).
$OUT/gradpass-<TAG>.json; one line per entry on stdout."""
import json, math, os, sys
import torch, triton
from vpce import kernels

TAG = os.environ.get("TAG", "tree")
OUT = os.path.join(os.environ.get("OUT", "/tmp"), f"gradpass-{TAG}.json")
HEADS = {"llama3-8b": (4096, 128256, 16384), "gemma2-2b": (2304, 256000, 8192)}


def ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=60, return_mode="median")


out = {"device": torch.cuda.get_device_name(), "tag": TAG, "vpce": kernels.__file__}
for head in os.environ.get("HEADS", "llama3-8b,gemma2-2b").split(","):
    d, v, c = HEADS[head]
    torch.manual_seed(0)
    x = torch.randn(c, d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(v, d, device="cuda") / math.sqrt(d) * 3).to(torch.bfloat16)
    t = torch.randint(0, v, (c,), device="cuda", dtype=torch.int32)
    p = torch.mm(x, w.t())
    f32 = dict(device="cuda", dtype=torch.float32)
    lse = torch.logsumexp(p.float(), 1)
    rows = (p.float().amax(1), lse, torch.full((c,), 0.5, **f32))
    s = torch.full((c,), 1.0 / c, **f32)
    plain = (s, None, -s, None)
    four = (s, 2e-4 * s, -0.9 * s, 0.1 * s / v)  # z-loss (b), smoothing (d): the all-four row's coefficient set
    n_tiles = triton.cdiv(v, kernels.tile_n(p))
    metr = dict(tile_ez=torch.empty(c, n_tiles, **f32), tile_m=torch.empty(c, n_tiles, **f32),
                tile_mb=torch.empty(c, n_tiles, **f32), before=t.clone())
    variants = {"plain": dict(coef=plain), "softcap": dict(coef=plain, softcap=30.0),
                "all four": dict(coef=four, softcap=30.0, class_weight=torch.rand(v, **f32)),
                "metrics": dict(coef=plain, **metr)}
    r = out[head] = {}
    for name, kw in variants.items():
        for bm, nw, mr in ((16, 4, None), (16, 4, 64), (16, 4, 56), (8, 4, None), (32, 4, None), (16, 8, None),
                           (32, 8, None)):
            label = f"{name} bm{bm} w{nw}" + (f" maxnreg{mr}" if mr else "")
            try:
                extra = {"maxnreg": mr} if mr else {}
                r[label] = ms(lambda: kernels.stored_logits(p, None, t, rows=rows, block_m=bm, num_warps=nw, **kw,
                                                            **extra))
            except Exception as e:  # noqa: BLE001
                r[label] = "failed: " + repr(e)[:160]
            print(head, TAG, label, r[label] if isinstance(r[label], str) else f"{r[label]:.3f} ms", flush=True)
        json.dump(out, open(OUT, "w"), indent=1)
    del x, w, p, rows, metr
    torch.cuda.empty_cache()
