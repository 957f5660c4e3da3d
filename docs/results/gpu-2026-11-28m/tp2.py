# one line per bench_tp run: TAG method=ms(x floor, GiB per rank)[errors] from the json's max-over-ranks rows
import json, sys
try:
    d = json.load(open(sys.argv[2]))
    f = lambda x: "-" if x is None else f"{x:.1e}"
    print(sys.argv[1], " ".join(f"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},{r.get('extra_gib') or 0:.2f}GiB)"
                                + ("" if r['method'] == 'floor' else f"[{f(r.get('loss_err'))},{f(r.get('dx_err'))},{f(r.get('dw_err'))}]")
                                for r in d["rows"] if r.get("rank") == "max"))
except Exception as e:
    print(sys.argv[1], "failed", e)
