"""The dX and dW configs with the least sum over both heads of (ms / that head's best), from the probes."""
import json, os, sys
o = os.environ["OUT"]
heads = [json.load(open(f"{o}/probe-{h}.json")) for h in ("llama", "gemma")]
lines = []
for what, name in (("dx", "DX_TILE"), ("dw", "DW_TILE")):
    rs = [{k: v for k, v in h[what].items() if isinstance(v, float) and not k.startswith("cublas")} for h in heads]
    common = set(rs[0]) & set(rs[1])
    best = [min(r.values()) for r in rs]
    k = min(common, key=lambda k: sum(r[k] / b for r, b in zip(rs, best)))
    print(what, k, [round(r[k], 2) for r in rs], "best", [round(b, 2) for b in best], file=sys.stderr)
    tm, rest = k.split("x", 1); tn, rest = rest.split(" c", 1); cl, kind = rest.split(" ")
    cm, cn = cl.split("x")
    lines.append(f"{name} = dict(tile_m={tm}, tile_n={tn}, cluster_m={cm}, cluster_n={cn}, pingpong={kind == 'pp'})")
print("\n".join(lines))
