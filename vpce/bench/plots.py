"""PNG plots of a sweep: fwd+bwd time, multiple of the floor, and extra memory against the swept axis.

matplotlib is optional (``pip install vpce[bench]``): without it ``plot_sweeps`` returns a note and draws nothing.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_sweeps"]

_AXIS_KEY = {"N": "n", "D": "d", "V": "v"}


def plot_sweeps(doc: dict, out: Path) -> tuple[list[Path], str | None]:
    """One ``sweep-<axis>.png`` per swept axis in ``doc``; returns (files written, note if skipped)."""
    axes = sorted({a for s in doc["shapes"] for a in s["sweeps"]}, key="NDV".index)
    if not axes:
        return [], None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return [], "matplotlib is not installed: no plots (pip install matplotlib)"

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
            xs = [p for p, _ in pts]
            label = pts[0][1]["label"]
            style = dict(color="black", linestyle="--") if method == "floor" else dict(marker="o")
            panels[0].plot(xs, [r["ms"] for _, r in pts], label=label, **style)
            if method != "floor":
                if all(r["x_floor"] is not None for _, r in pts):
                    panels[1].plot(xs, [r["x_floor"] for _, r in pts], label=label, **style)
                if all(r["extra_gib"] is not None for _, r in pts):
                    panels[2].plot(xs, [r["extra_gib"] for _, r in pts], label=label, **style)
        panels[1].axhline(1.0, color="black", linestyle="--", linewidth=1)
        titles = ("fwd+bwd median (ms)", "multiple of the 3-GEMM floor", "peak extra memory (GiB)")
        ticks = sorted({r[key] for r in rows})
        for ax, title in zip(panels, titles):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xlabel(axis)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        panels[0].set_yscale("log")
        panels[2].set_yscale("log")
        panels[0].legend(fontsize=8)
        fixed_text = ", ".join(f"{k}={v}" for k, v in fixed.items())
        fig.suptitle(f"sweep over {axis} ({fixed_text}), {doc['dtype']}, {doc['device']['name']}")
        fig.tight_layout()
        path = out / f"sweep-{axis}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written, None
