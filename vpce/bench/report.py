"""What the benchmark shows: progress lines on stderr, one table per shape on stdout, and the JSON file.

The tables fit ``WIDTH`` (120) columns: a row is named by its ``--methods`` key (its long label is in the JSON
and in the progress lines), its status column says ``ok``, ``missing`` or ``failed`` (with ``timeout`` or ``out of
memory`` where that is the reason), and the full reasons follow the table, one line per distinct reason with the
rows it applies to.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time
from pathlib import Path

__all__ = ["Progress", "format_shape", "format_tp_shape", "write_json", "format_number", "markdown_table",
           "short_status", "status_notes", "WIDTH"]

#: Widest line of a table or a header (a terminal, a pasted issue comment).
WIDTH = 120

#: (header, row key, number format or None for text) of the fwd+bwd, frozen-weight and no-grad tables.
GRAD_COLUMNS = (("method", "method", None), ("ms", "ms", "ms"), ("x floor", "x_floor", ".2f"),
                ("extra GiB", "extra_gib", "gib"), ("loss err", "loss_err", ".1e"), ("dX err", "dx_err", ".1e"),
                ("dW err", "dw_err", ".1e"), ("status", "short_status", None))
FROZEN_COLUMNS = (("method", "method", None), ("ms", "ms", "ms"), ("x 2 GEMMs", "x_floor", ".2f"),
                  ("extra GiB", "extra_gib", "gib"), ("loss err", "loss_err", ".1e"), ("dX err", "dx_err", ".1e"),
                  ("status", "short_status", None))
NO_GRAD_COLUMNS = (("method", "method", None), ("ms", "ms", "ms"), ("x GEMM", "x_floor", ".2f"),
                   ("extra GiB", "extra_gib", "gib"), ("loss err", "loss_err", ".1e"), ("status", "short_status", None))


_FLOOR_WORDS = {"floor": "floor", "fwd+bwd": "floor", "frozen": "2-GEMM floor", "no-grad": "logits GEMM"}


class Progress:
    """One line on stderr when a shape starts, when a row starts, and when it finishes."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.i = self.total = 0
        self.shape_name = ""

    def _print(self, text: str, always: bool = False):
        if self.enabled or always:
            print(f"[{time.perf_counter() - self.t0:7.1f}s] {text}", file=self.stream, flush=True)

    def shape(self, shape, env, total: int):
        self.i, self.total, self.shape_name = 0, total, shape.name
        self._print(f"== {shape.describe()} {str(env.dtype).removeprefix('torch.')} on {env.device}")

    def note(self, text: str):
        self._print(f"   {text}")

    def warn(self, text: str):
        """A line printed even when progress lines are off (``--quiet``)."""
        self._print(text, always=True)

    def start(self, row: dict):
        self.i += 1
        self._print(f"{self.shape_name} [{self.i}/{self.total}] {row['label']} ...")

    def finish(self, row: dict):
        if row["status"] != "ok":
            what = row["status"]
        else:
            what = f"{row['ms']:.3f} ms"
            if row["x_floor"] is not None:
                what += f" ({row['x_floor']:.2f}x {_FLOOR_WORDS[row['mode']]})"
            if row["extra_gib"] is not None:
                what += f", +{format_number(row['extra_gib'], 'gib')} GiB"
        self._print(f"{self.shape_name} [{self.i}/{self.total}] {row['label']}: {what}")


def format_number(v, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if fmt == "ms":  # two decimals; three below 1 ms (tiny --quick shapes)
        fmt = ".3f" if v < 1 else ".2f"
    elif fmt == "gib":  # two decimals; three significant digits below 0.1 GiB
        fmt = ".3g" if abs(v) < 0.1 else ".2f"
    return format(v, fmt)


def short_status(status: str) -> str:
    """The status column: ``ok``, ``missing``, ``failed``, or ``failed: timeout`` / ``failed: out of memory``."""
    kind, _, why = status.partition(":")
    for short in ("timeout", "out of memory", "not run"):
        if why.strip().startswith(short):
            return f"{kind}: {short}"
    return kind


def status_notes(rows: list[dict], key: str = "method") -> list[str]:
    """One wrapped line per distinct reason a row is not ``ok``: ``- <status>: <rows>``."""
    by: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            by.setdefault(r["status"], []).append(r[key] + (" (no-grad)" if r.get("mode") == "no-grad" else ""))
    return [line for status, names in by.items()
            for line in textwrap.wrap(f"- {status}: {', '.join(names)}", WIDTH, subsequent_indent="  ",
                                      break_on_hyphens=False)]


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False) or [""]


def markdown_table(rows: list[dict], columns) -> list[str]:
    """A Markdown table: text left-aligned, numbers right-aligned."""
    def cell(r, k, f):
        if k == "short_status":
            return short_status(r["status"])
        return r[k] if f is None else format_number(r[k], f)
    cells = [[h for h, _, _ in columns]] + [[cell(r, k, f) for _, k, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for k, c in enumerate(cells):
        out.append("| " + " | ".join(s.ljust(wd) if f is None else s.rjust(wd)
                                     for s, wd, (_, _, f) in zip(c, widths, columns)) + " |")
        if k == 0:
            out.append("|" + "|".join("-" * (wd + 2) for wd in widths) + "|")
    return out


def _floor_text(floor: dict, flops: float) -> str:
    tflops = flops / (floor["total_ms"] * 1e-3) / 1e12
    teacher = f"teacher logits {floor['teacher_logits_ms']:.2f} + " if "teacher_logits_ms" in floor else ""
    return (f"{floor['total_ms']:.2f} ms = {teacher}logits {floor['logits_ms']:.2f} + dX {floor['dx_ms']:.2f} + dW "
            f"{floor['dw_ms']:.2f} ms ({tflops:.3g} TFLOP/s)"
            + (f", each GEMM over {floor['chunks']} token chunks" if floor.get("chunks", 1) > 1 else ""))


def _shape_title(record: dict) -> str:
    """``name: N= D= V=``, or for a distillation shape ``name distillation: N= D= D_T= V=``."""
    if "d_teacher" in record:
        return (f"{record['name']} distillation: N={record['n']} D={record['d']} teacher D_T={record['d_teacher']} "
                f"V={record['v']}")
    return f"{record['name']}: N={record['n']} D={record['d']} V={record['v']}"


def _ref_text(record: dict) -> str:
    """The float64 loss of the shape, or of each divergence measured (distillation)."""
    if "ref_losses" not in record:
        return "-" if record["ref_loss"] is None else f"{record['ref_loss']:.6f}"
    text = ", ".join(f"{k} {v:.6f}" for k, v in record["ref_losses"].items()) or "none computed"
    errs = record.get("gemm_logits_loss_errs")
    if errs:  # one device: what the GEMM's rounded logits alone give away (harness.gemm_logits_loss)
        text += "; loss error of float64 math on the GEMM's logits: " + ", ".join(
            f"{k} {v:.1e}" for k, v in errs.items())
    return text


def format_shape(record: dict, rows: list[dict], dtype: str, device: str) -> str:
    """The shape's header line and its tables (fwd+bwd against the floor; frozen weight against the logits and dX
    GEMMs; no-grad against the logits GEMM). A distillation shape has the fwd+bwd table only, against the floor
    teacher logits + the student's three GEMMs, and the float64 loss of each divergence."""
    lines = _wrap(f"## {_shape_title(record)}, {dtype}, {device}")
    floor = record["floor"]
    losses = "float64 losses: " if "ref_losses" in record else "float64 loss "
    if floor:
        lines += _wrap(f"floor {_floor_text(floor, record['flops_fwd_bwd'])}; dX+dW themselves "
                       f"{format_number(record['grads_gib'], 'gib')} GiB; {losses}{_ref_text(record)}")
    else:
        lines += _wrap(f"floor not measured; dX+dW themselves {format_number(record['grads_gib'], 'gib')} GiB; "
                       f"{losses}{_ref_text(record)}")
    grad = [r for r in rows if r["mode"] in ("floor", "fwd+bwd")]
    frozen = [r for r in rows if r["mode"] == "frozen"]
    nograd = [r for r in rows if r["mode"] == "no-grad"]
    lines += [""] + markdown_table(grad, GRAD_COLUMNS)
    if frozen:
        two = f" = {format_number(floor['frozen_ms'], 'ms')} ms" if floor else " (not measured)"
        lines += ["", f"frozen lm_head (weight.requires_grad=False, as LoRA), against the 2-GEMM floor logits + dX"
                      f"{two}:"]
        lines += markdown_table(frozen, FROZEN_COLUMNS)
    if nograd:
        lines += ["", "no-grad forward, against the logits GEMM alone:"]
        lines += markdown_table(nograd, NO_GRAD_COLUMNS)
    notes = status_notes(rows)
    if notes:
        lines += ["", "rows not measured (the JSON has each row's label, status and traceback):"] + notes
    return "\n".join(lines) + "\n"


def format_tp_shape(record: dict, aggs: list[dict], per_rank: list[dict], doc: dict, where: str) -> str:
    """Under ``--tp``: the shape's header, the table of maxima over ranks, the per-rank table, and the notes."""
    tp = doc["tp"]
    lines = [f"## {_shape_title(record)}, {doc['dtype']}, tp={tp}, hidden {record['layout']}, {where}"]
    rows = record["rows_per_rank"]
    rows_text = str(rows[0]) if len(set(rows)) == 1 else f"{min(rows)}..{max(rows)}"
    lines.append(f"vocab rows per rank {rows_text}; hidden tokens per rank {record['tokens_per_rank']}; "
                 f"dX + dW shard themselves {format_number(record['grads_gib'], 'gib')} GiB per rank")
    if record["status"] != "ok":
        lines.append(f"not measured: {record['status']}")
    else:
        floor = record["floor"]
        losses = "float64 losses: " if "ref_losses" in record else "float64 loss "
        if floor:
            lines.append(f"per-rank floor (slowest rank, {floor['rank']}) "
                         f"{_floor_text(floor, record['flops_fwd_bwd_per_rank'])}; {losses}{_ref_text(record)}")
        else:
            lines.append(f"per-rank floor not measured; {losses}{_ref_text(record)}")
        comm = record["comm"]
        if comm:
            ms = "-" if comm["ms"] is None else f"{format_number(comm['ms'], 'ms')} ms (slowest rank)"
            lines.append(f"communication alone, not in the floor: {comm['what']}: {ms}")
    lines.append(f"ms, extra GiB: the maximum over the {tp} ranks of each rank's median step and peak; x floor: "
                 f"over the slowest rank's floor; loss err: largest over ranks; dX err, dW err: the whole gradients")
    lines += [""] + markdown_table(aggs, GRAD_COLUMNS)
    ranks = sorted({r["rank"] for r in per_rank})
    if len(ranks) > 1:
        by = {(r["method"], r["rank"]): r for r in per_rank}
        cols = [("method", "method", None)] + [(f"r{k} ms", f"ms{k}", "ms") for k in ranks] + \
            [(f"r{k} GiB", f"gib{k}", "gib") for k in ranks]
        table = []
        for a in aggs:
            t = dict(method=a["method"])
            for k in ranks:
                r = by.get((a["method"], k), {})
                t[f"ms{k}"], t[f"gib{k}"] = r.get("ms"), r.get("extra_gib")
            table.append(t)
        lines += ["", "per rank: median step ms and peak extra GiB"] + markdown_table(table, cols)
    notes = status_notes(aggs)
    if notes:
        lines += ["", "rows not measured:"] + notes
    notes = [f"- {a['method']}: {a['note']}" for a in aggs if a.get("note")]
    if notes:
        lines += ["", "notes (rank 0):"] + notes
    return "\n".join(lines) + "\n"


def _finite(obj):
    """JSON has no NaN/inf: they become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: Path, doc: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(doc), indent=1) + "\n")
