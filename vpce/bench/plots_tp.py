"""Time and memory against ``tp``, from the JSON files of several ``python -m vpce.bench --tp`` runs.

    python -m vpce.bench.plots_tp bench-out/bench-tp1.json bench-out/bench-tp2.json bench-out/bench-tp4.json \\
        [--out DIR]

Each file is one run (one ``tp``, one layout). The files are grouped by shape, layout and dtype; for each group
this prints a Markdown table (per row and ``tp``: the per-rank ms, its multiple of the per-rank floor and the
per-rank peak extra GiB, all maxima over ranks as in the run's own table) and draws
``DIR/tp-<shape>-<layout>.png`` with three panels against ``tp``: per-rank ms (the per-rank floor dashed), the
multiple of the floor, and the per-rank peak extra memory. Rows that were not ``ok`` are left out of the plot and
show their status in the table. The float64 loss of a shape does not depend on ``tp`` (same seed, same problem);
a group whose files disagree on it gets a warning. ``DIR`` defaults to the first file's folder. matplotlib is
optional: without it only the tables are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .methods import method_names
from .plots import format_panels, plot_series, pyplot
from .report import format_number, markdown_table

__all__ = ["load_runs", "group_runs", "format_group", "plot_group", "main"]

SCHEMA = "vpce.bench.tp/1"


def load_runs(paths: list[Path]) -> list[dict]:
    runs = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"{path}: expected a --tp run (schema {SCHEMA!r}), got schema {doc.get('schema')!r}")
        doc["_path"] = str(path)
        runs.append(doc)
    return runs


def group_runs(runs: list[dict]) -> dict[tuple[str, str, str], dict[int, tuple[dict, dict]]]:
    """``{(shape, layout, dtype): {tp: (shape record, {method: aggregate row})}}``; one run per tp and group."""
    groups: dict = {}
    for doc in runs:
        for record in doc["shapes"]:
            key = (record["name"], doc["layout"], doc["dtype"])
            rows = {r["method"]: r for r in doc["rows"] if r["shape"] == record["name"] and r["rank"] == "max"}
            per_tp = groups.setdefault(key, {})
            if doc["tp"] in per_tp:
                raise ValueError(f"two runs at tp={doc['tp']} for shape {key[0]}, layout {key[1]}, {key[2]}: "
                                 f"{per_tp[doc['tp']][0]['_path']} and {doc['_path']}")
            per_tp[doc["tp"]] = (dict(record, _path=doc["_path"], _devices=doc["devices"]), rows)
    return groups


def _methods(per_tp: dict) -> list[tuple[str, str]]:
    """(name, label) of every row in any run of the group, in the benchmark's table order."""
    seen: dict[str, str] = {}
    for tp in sorted(per_tp):
        for name, row in per_tp[tp][1].items():
            seen.setdefault(name, row["label"])
    order = {name: i for i, name in enumerate(method_names())}
    return sorted(seen.items(), key=lambda item: order.get(item[0], len(order)))


def format_group(key, per_tp) -> str:
    shape, layout, dtype = key
    tps = sorted(per_tp)
    first = per_tp[tps[0]][0]
    lines = [f"## {shape}: N={first['n']} D={first['d']} V={first['v']}, {dtype}, hidden {layout}, tp = "
             f"{', '.join(map(str, tps))}"]
    losses = {tp: per_tp[tp][0]["ref_loss"] for tp in tps}
    known = [v for v in losses.values() if v is not None]
    if known and max(known) - min(known) > 1e-9 * abs(known[0]):
        lines.append("WARNING: the float64 loss differs between runs (not the same problem): " +
                     ", ".join(f"tp={tp}: {v}" for tp, v in losses.items()))
    elif known:
        lines.append(f"float64 loss {known[0]:.6f} at every tp (the same problem)")
    lines.append("per tp: per-rank ms (max over ranks) / x per-rank floor / per-rank peak extra GiB (max over ranks)")
    cols = [("method", "label", None)] + [(f"tp={tp}", f"tp{tp}", None) for tp in tps]
    table = []
    for name, label in _methods(per_tp):
        t = dict(label=label)
        for tp in tps:
            r = per_tp[tp][1].get(name)
            if r is None:
                t[f"tp{tp}"] = "not run"
            elif r["status"] != "ok":
                t[f"tp{tp}"] = r["status"] if len(r["status"]) <= 40 else r["status"][:37] + "..."
            else:
                parts = [f"{format_number(r['ms'], 'ms')} ms"]
                if r["mode"] != "floor" and r["x_floor"] is not None:
                    parts.append(f"{r['x_floor']:.2f}x")
                if r["extra_gib"] is not None:
                    parts.append(f"{format_number(r['extra_gib'], 'gib')} GiB")
                t[f"tp{tp}"] = " / ".join(parts)
        table.append(t)
    return "\n".join(lines + [""] + markdown_table(table, cols)) + "\n"


def plot_group(key, per_tp, out: Path) -> Path | None:
    """``out/tp-<shape>-<layout>.png``; None when matplotlib is missing or nothing ran."""
    plt = pyplot()
    if plt is None:
        return None
    shape, layout, dtype = key
    tps = sorted(per_tp)
    fig, panels = plt.subplots(1, 3, figsize=(16, 4.8))
    drawn = False
    for name, label in _methods(per_tp):
        pts = [(tp, per_tp[tp][1][name]) for tp in tps
               if name in per_tp[tp][1] and per_tp[tp][1][name]["status"] == "ok"]
        if not pts:
            continue
        drawn = True
        plot_series(panels, [tp for tp, _ in pts], [r for _, r in pts], name, label)
    if not drawn:
        plt.close(fig)
        return None
    format_panels(panels, tps, "tp", ("per-rank fwd+bwd ms (max over ranks)", "multiple of the per-rank floor",
                                      "per-rank peak extra memory (GiB)"))
    first = per_tp[tps[0]][0]
    devices = sorted({d["name"] for tp in tps for d in per_tp[tp][0]["_devices"]})
    fig.suptitle(f"{shape} (N={first['n']}, D={first['d']}, V={first['v']}), hidden {layout}, {dtype}, "
                 f"{' / '.join(devices)}")
    fig.tight_layout()
    path = out / f"tp-{shape}-{layout}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vpce.bench.plots_tp",
                                description="Tables and plots of per-rank time and memory against tp, from the "
                                            "JSON files of several `python -m vpce.bench --tp` runs.")
    p.add_argument("files", nargs="+", type=Path, help="bench-tp<K>[-sp].json files, one per tp (and layout)")
    p.add_argument("--out", type=Path, default=None, help="folder for the PNG files (default: the first file's)")
    args = p.parse_args(argv)
    try:
        groups = group_runs(load_runs(args.files))
    except (OSError, ValueError, KeyError) as e:
        p.error(str(e))
    out = args.out or args.files[0].parent
    out.mkdir(parents=True, exist_ok=True)
    missing_plot = False
    for key, per_tp in groups.items():
        print(format_group(key, per_tp), flush=True)
        path = plot_group(key, per_tp, out)
        if path is not None:
            print(f"wrote {path}", file=sys.stderr)
        else:
            missing_plot = True
    if missing_plot:
        print("some groups have no plot (matplotlib missing, or no row ran)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
