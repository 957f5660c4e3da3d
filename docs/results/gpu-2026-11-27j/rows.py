# one line per row of a bench.json: method=ms(x floor, extra GiB, dX err, dW err)
import json, sys
try:
    d = json.load(open(sys.argv[2]))
    for r in d["rows"]:
        print(sys.argv[1], f"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},{r.get('extra_gib') or 0:.2f}GiB,"
              f"dx{r.get('dx_err') or 0:.1e},dw{r.get('dw_err') or 0:.1e}) {r.get('status') or ''} {str(r.get('error') or '')[:200]}")
except Exception as e:
    print(sys.argv[1], "failed", e)
