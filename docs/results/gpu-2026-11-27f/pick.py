"""The config of qlse2.json with the least summed time over every head, plain and capped; prints the LOGITS_TILE
line for vpce/gemm.py."""
import json, re, sys
d = json.load(open(sys.argv[1]))
tot = {}
for head, rows in d.items():
    if not isinstance(rows, dict):
        continue
    for k, r in rows.items():
        m = re.match(r"(plain|cap) se (\d+)x(\d+) c(\d)x(\d) (pp|coop)", k)
        if m and isinstance(r, dict) and "ms" in r:
            key = m.groups()[1:]
            tot.setdefault(key, []).append(r["ms"])
n = max(len(v) for v in tot.values())
best = min((sum(v), k) for k, v in tot.items() if len(v) == n)
for k, v in sorted(tot.items(), key=lambda kv: sum(kv[1])):
    print("#", k, ["%.2f" % x for x in v], "%.2f" % sum(v), file=sys.stderr)
tm, tn, cm, cn, pp = best[1]
print(f"LOGITS_TILE = dict(tile_m={tm}, tile_n={tn}, cluster_m={cm}, cluster_n={cn}, pingpong={pp == 'pp'})")
