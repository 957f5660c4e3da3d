"""PNG plots of a run: per named shape, time and extra memory of every row; per sweep, time, multiple of the floor
and extra memory against the swept axis. ``vpce.bench.plots_tp`` draws several ``--tp`` runs against ``tp``.

matplotlib is optional (``pip install vpce[bench]``): without it the plot functions return a note and draw nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["pyplot", "plot_series", "format_panels", "plot_shapes", "plot_sweeps", "NO_MATPLOTLIB"]

_AXIS_KEY = {"N": "n", "D": "d", "V": "v"}
NO_MATPLOTLIB = "matplotlib is not installed: no plots (pip install matplotlib)"


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_series(panels, xs: list, rows: list[dict], name: str, label: str):
    """One row's line against ``xs`` on the three panels (ms; multiple of the floor; extra GiB); the floor
    itself is a dashed black line on the first panel only."""
    style = dict(color="black", linestyle="--") if name == "floor" else dict(marker="o")
    panels[0].plot(xs, [r["ms"] for r in rows], label=label, **style)
    if name == "floor":
        return
    for ax, key in ((panels[1], "x_floor"), (panels[2], "extra_gib")):
        pts = [(x, r[key]) for x, r in zip(xs, rows) if r[key] is not None]  # e.g. no multiple where the floor failed
        if pts:
            ax.plot(*zip(*pts), label=label, **style)


def format_panels(panels, ticks: list, xlabel: str, titles: tuple[str, str, str]):
    """The three panels of ``plot_series`` against a log2 x axis labelled at ``ticks``: titles, grid, log time and
    memory, the floor's multiple 1 as a dashed line, the legend on the first panel."""
    import matplotlib.ticker

    panels[1].axhline(1.0, color="black", linestyle="--", linewidth=1)
    for ax, title in zip(panels, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    panels[0].set_yscale("log")
    panels[2].set_yscale("log")
    panels[0].legend(fontsize=8)


_MODE_COLOR = {"frozen": "tab:orange", "no-grad": "tab:gray"}


def _file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def plot_shapes(doc: dict, out: Path, stem: str = "bench") -> tuple[list[Path], str | None]:
    """One ``<stem>-<shape>.png`` per shape of ``doc`` that is not a sweep point: horizontal bars of every row
    that ran, time (the floor; for frozen-weight rows the logits and dX GEMMs; for no-grad rows the logits GEMM; as
    dashed lines) and peak extra memory.
    Returns (files written, note if skipped)."""
    shapes = [s for s in doc["shapes"] if not s["sweeps"]]
    if not shapes:
        return [], None
    plt = pyplot()
    if plt is None:
        return [], NO_MATPLOTLIB
    written = []
    for shape in shapes:
        rows = [r for r in doc["rows"] if r["shape"] == shape["name"] and r["status"] == "ok" and r["mode"] != "floor"]
        if not rows:
            continue
        fig, (t_ax, m_ax) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 1.8), sharey=True)
        ys = list(range(len(rows)))[::-1]
        colors = [_MODE_COLOR.get(r["mode"], "tab:blue") for r in rows]
        t_ax.barh(ys, [r["ms"] for r in rows], color=colors)
        m_ax.barh(ys, [r["extra_gib"] or 0.0 for r in rows], color=colors)
        t_ax.set_yticks(ys, [r["label"] for r in rows])
        floor = shape.get("floor")
        if floor:
            what = "teacher logits + 3 GEMMs" if "teacher_logits_ms" in floor else "3 GEMMs"
            t_ax.axvline(floor["total_ms"], color="black", linestyle="--", linewidth=1, label=f"floor: {what}")
            if any(r["mode"] == "frozen" for r in rows):
                t_ax.axvline(floor["frozen_ms"], color="tab:orange", linestyle="-.", linewidth=1,
                             label="logits + dX GEMMs")
            if any(r["mode"] == "no-grad" for r in rows):
                t_ax.axvline(floor["logits_ms"], color="tab:gray", linestyle=":", linewidth=1, label="logits GEMM")
            t_ax.legend(fontsize=8)
        t_ax.set_xlabel("median ms (fwd+bwd; orange: frozen weight; gray: no-grad forward)")
        m_ax.set_xlabel("peak extra GiB")
        for ax in (t_ax, m_ax):
            ax.grid(True, axis="x", alpha=0.3)
        where = doc["device"]["name"] + (f", tp={doc['tp']} (max over ranks)" if doc.get("tp", 1) > 1 else "")
        teacher = f", teacher D_T={shape['d_teacher']}" if "d_teacher" in shape else ""
        fig.suptitle(f"{shape['name']} (N={shape['n']}, D={shape['d']}{teacher}, V={shape['v']}), {doc['dtype']}, "
                     f"{where}")
        fig.tight_layout()
        path = out / f"{stem}-{_file_name(shape['name'])}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written, None


def plot_sweeps(doc: dict, out: Path) -> tuple[list[Path], str | None]:
    """One ``sweep-<axis>.png`` per swept axis in ``doc``; returns (files written, note if skipped)."""
    axes = sorted({a for s in doc["shapes"] for a in s["sweeps"]}, key="NDV".index)
    if not axes:
        return [], None
    plt = pyplot()
    if plt is None:
        return [], NO_MATPLOTLIB
    written = []
    for axis in axes:
        key = _AXIS_KEY[axis]
        names = {s["name"] for s in doc["shapes"] if axis in s["sweeps"]}
        rows = [r for r in doc["rows"] if r["shape"] in names and r["mode"] != "no-grad" and r["status"] == "ok"]
        if not rows:
            continue
        fixed = {k: v for k, v in (("N", rows[0]["n"]), ("D", rows[0]["d"]), ("V", rows[0]["v"])) if k != axis}
        fig, panels = plt.subplots(1, 3, figsize=(16, 4.8))
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r[key], r) for r in rows if r["method"] == method)
            plot_series(panels, [p for p, _ in pts], [r for _, r in pts], method, pts[0][1]["label"])
        format_panels(panels, sorted({r[key] for r in rows}), axis,
                      ("fwd+bwd median (ms)", "multiple of the floor (3 GEMMs; frozen W: 2)",
                       "peak extra memory (GiB)"))
        fixed_text = ", ".join(f"{k}={v}" for k, v in fixed.items())
        fig.suptitle(f"sweep over {axis} ({fixed_text}), {doc['dtype']}, {doc['device']['name']}")
        fig.tight_layout()
        path = out / f"sweep-{axis}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written, None
