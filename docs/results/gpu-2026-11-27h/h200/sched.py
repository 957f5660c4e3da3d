"""#36: the three GEMMs of a step on one head, scheduled as vpce's one chunk (quack dX and dW at the tree's pinned
configs, cuBLAS logits) and as quack's base path does (4096-row chunks: cuBLAS logits and dX in bf16, quack dW into
an fp32 accumulator, the last chunk's scaled into bf16), and mixes; each schedule run back to back 5 times after a
warm-up, the median of the whole sequence (CUDA events) and of each GEMM kind. $OUT/sched.json."""
import json, os, statistics
import torch
from quack import gemm_interface as q
from quack.gemm_config import GemmConfig
from vpce import gemm as G, kernels

OUT = os.path.join(os.environ.get("OUT", "/tmp"), "sched.json")
HEADS = {"llama3-8b": (4096, 128256, 16384), "gemma2-2b": (2304, 256000, 8192)}


def cfg(t):
    return GemmConfig(**t, is_dynamic_persistent=False)


def run(steps, reps=5):
    """steps: [(kind, fn)]; returns (median total ms, {kind: median ms})."""
    for _, fn in steps:
        fn()
    totals, kinds = [], {}
    for _ in range(reps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
        ev[0].record()
        for i, (_, fn) in enumerate(steps):
            fn(); ev[i + 1].record()
        torch.cuda.synchronize()
        totals.append(ev[0].elapsed_time(ev[-1]))
        per = {}
        for i, (k, _) in enumerate(steps):
            per[k] = per.get(k, 0.0) + ev[i].elapsed_time(ev[i + 1])
        for k, v in per.items():
            kinds.setdefault(k, []).append(v)
    return statistics.median(totals), {k: round(statistics.median(v), 3) for k, v in kinds.items()}


out = {"device": torch.cuda.get_device_name(), "dx_tile": G._dx_tile(torch.cuda.current_device()),
       "dw_tile": G.DW_TILE, "dw_add_tile": G.DW_ADD_TILE}
for head in os.environ.get("HEADS", "llama3-8b,gemma2-2b").split(","):
    d, v, n = HEADS[head]
    torch.manual_seed(0)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16)
    p = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    p.normal_().mul_(1e-3)
    s = torch.full((1,), 0.37, device="cuda")
    acc = torch.empty(v, d, device="cuda", dtype=torch.float32)
    dw = torch.empty(v, d, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
    r = out[head] = {}

    def one_chunk():
        return [("logits", lambda: torch.mm(x, w.t(), out=p)),
                ("dx", lambda: G.scaled_hidden_grad(p, w, s, torch.bfloat16)),
                ("dw", lambda: G.scaled_weight_grad(None, p, x, s, torch.bfloat16))]

    def chunked(k, dx_cublas=True, dw_first=None):
        c = n // k
        st = []
        for i in range(k):
            sl = slice(i * c, (i + 1) * c)
            st.append(("logits", lambda sl=sl: torch.mm(x[sl], w.t(), out=p[sl])))
            if dx_cublas:
                st.append(("dx", lambda sl=sl: torch.mm(p[sl], w, out=dx[sl])))
            else:
                st.append(("dx", lambda sl=sl: q.gemm_tuned.fn(p[sl], w, dx[sl], alpha=s, config=cfg(G._dx_tile(0)))))
            if i == 0:
                st.append(("dw", lambda sl=sl: q.gemm_tuned.fn(p[sl].t(), x[sl], acc, config=cfg(dw_first or G.DW_ADD_TILE))))
            elif i < k - 1:
                st.append(("dw", lambda sl=sl: q.gemm_tuned.fn(p[sl].t(), x[sl], acc, C=acc, config=cfg(G.DW_ADD_TILE))))
            else:
                st.append(("dw", lambda sl=sl: q.gemm_tuned.fn(p[sl].t(), x[sl], dw, C=acc, alpha=s, beta=s,
                                                                config=cfg(G.DW_ADD_TILE))))
        return st

    dx32 = torch.empty(n, d, device="cuda", dtype=torch.float32)

    def mixed(k, fp32=False):  # one-shot logits and dW, dX in k cuBLAS chunks (fp32: then scaled and cast, exact)
        c = n // k
        st = [("logits", lambda: torch.mm(x, w.t(), out=p))]
        out = dx32 if fp32 else dx
        st += [("dx", lambda i=i: torch.mm(p[i * c:(i + 1) * c], w, out=out[i * c:(i + 1) * c])) for i in range(k)]
        if fp32:
            st.append(("dx", lambda: kernels.scale_cast(dx32, s[0], torch.bfloat16)))
        st.append(("dw", lambda: G.scaled_weight_grad(None, p, x, s, torch.bfloat16)))
        return st

    scheds = {"one chunk (vpce)": one_chunk(), "4 chunks, cuBLAS dX (quack base)": chunked(4),
              "2 chunks, cuBLAS dX": chunked(2), "4 chunks, quack dX": chunked(4, dx_cublas=False),
              "one-shot logits + dW, dX in 4 cuBLAS chunks": mixed(4),
              "one-shot logits + dW, dX in 4 cuBLAS fp32 chunks + scale_cast": mixed(4, fp32=True),
              "one-shot logits + dW, dX in 2 cuBLAS fp32 chunks + scale_cast": mixed(2, fp32=True),
              "floor: 3 cuBLAS GEMMs": [("logits", lambda: torch.mm(x, w.t(), out=p)), ("dx", lambda: torch.mm(p, w, out=dx)),
                                        ("dw", lambda: torch.mm(p.t(), x, out=dw))]}
    for rnd in (0, 1):
        for name, st in (scheds.items() if rnd == 0 else reversed(list(scheds.items()))):
            try:
                tot, kinds = run(st)
                prev = r.get(name)
                if not isinstance(prev, dict) or tot < prev["ms"]:
                    r[name] = {"ms": round(tot, 3), **kinds}
            except Exception as e:  # noqa: BLE001
                r[name] = "failed: " + repr(e)[:200]
            print(head, rnd, name, r[name], flush=True)
            json.dump(out, open(OUT, "w"), indent=1)
    del x, w, p, acc, dw, dx, dx32
    torch.cuda.empty_cache()
