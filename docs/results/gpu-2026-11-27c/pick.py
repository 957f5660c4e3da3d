"""Print the fastest quack config of qdw2.json for one head as DW_TILE's comma form (tile_m,tile_n,cm,cn,pp,swap)."""
import json, os, re, sys
d = json.load(open(os.path.join(os.environ["OUT"], "qdw2.json")))[sys.argv[1]]
best = min(((v["ms"], k) for k, v in d.items() if isinstance(v, dict) and "x" in k and k[0].isdigit()), default=None)
m = re.match(r"(\d+)x(\d+) c(\d)x(\d) (pp|coop)( swap)?", best[1])
print(",".join([m[1], m[2], m[3], m[4], "1" if m[5] == "pp" else "0", "1" if m[6] else "0"]))
