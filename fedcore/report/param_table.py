"""SGPT Table 5: trainable-parameter counts (from the param_counts probe) beside the paper's, in its layout.

The paper's table has one column per model (method over architecture) and one row of counts. Ours adds
a row with the paper's number and a row with the difference. The counted models are the paper's
architectures at every scale (nothing is trained), so the difference is meaningful at every scale.
"""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pandas as pd

from fedcore.io import atomic_path
from fedcore.report.resolution import exact_resolution
from fedcore.report.tables import NO_PAPER, latex_escape

OK = "ok"
PARAM_COLUMNS = ["column", "method", "architecture", "source", "arch", "trainable", "total", "paper", "diff",
                 "status", "device"]
NOTE = ("Counted on models built with random weights (no training, no weight files); the paper's "
        "architectures at every scale. FedAvg trains every parameter; a prompt method only its trainable ones, "
        "built with the experiment's method parameters at paper scale. Δ = ours − paper.")


def build_param_table(counts: pd.DataFrame, table_cfg: dict) -> pd.DataFrame:
    """One row per table column: the config's headers and paper number joined with the probe's counts."""
    cols = table_cfg["columns"]
    if len(counts) != len(cols) or list(counts["column"]) != list(range(len(cols))):
        raise ValueError(f"param counts hold columns {list(counts['column'])}, the table has {len(cols)}: "
                         "rerun the param_counts probe")
    rows = []
    which = table_cfg.get("count", "trainable")   # FedHPL Table 7 counts entire models; FedPFT Table 10 uploads
    for j, (col, cnt) in enumerate(zip(cols, counts.itertuples())):
        paper = math.nan if col.get("paper") is None else float(col["paper"])
        value = getattr(cnt, which, math.nan)
        ours = float(value) if cnt.status == OK and not pd.isna(value) else math.nan
        rows.append({"column": j, "method": col["method"], "architecture": col["architecture"],
                     "source": cnt.source, "arch": cnt.arch, "trainable": ours,
                     "total": float(cnt.total) if not pd.isna(cnt.total) else math.nan, "paper": paper,
                     "diff": ours - paper, "status": cnt.status,
                     "device": "" if pd.isna(cnt.device) else cnt.device})
    out = pd.DataFrame(rows, columns=PARAM_COLUMNS)
    return out.astype({"trainable": "Int64", "total": "Int64"})


def _millions(x: float, exact: bool) -> str:
    """'11.23M (11,227,812)' for ours, '11M' for the paper's rounded number, the dash for none."""
    if x is None or pd.isna(x):
        return NO_PAPER
    if exact:
        return f"{x / 1e6:.2f}M ({int(x):,})"
    return f"{x / 1e6:g}M"


def _cells(table: pd.DataFrame) -> dict[str, list[str]]:
    """The table's rows (label -> one text per column)."""
    ours = [(_millions(r.trainable, True) if r.status == OK else r.status) for r in table.itertuples()]
    return {
        "Architecture": list(table["architecture"]),
        "# Parameters ↓ (ours)": ours,
        "# Parameters ↓ (paper)": [_millions(p, False) for p in table["paper"]],
        "Δ (M)": [NO_PAPER if pd.isna(d) else f"{d / 1e6:+.2f}" for d in table["diff"]],
    }


def _best(table: pd.DataFrame) -> list[bool]:
    """The fewest trainable parameters among ours (bold, as the paper bolds its own column)."""
    ok = table["trainable"].astype("Float64")
    best = ok.min(skipna=True)
    return [bool(not pd.isna(v) and v == best) for v in ok]


GRID_NOTE = ("Counted on models built with random weights on the meta device (no training, no weight files), the "
             "paper's architectures at every scale, each method's paper-scale parameters; every parameter of the "
             "model (frozen ones included). Δ = ours − paper.")


def footnotes(table: pd.DataFrame, grid: bool = False) -> list[str]:
    """Notes under the table."""
    notes = [GRID_NOTE if grid else NOTE]
    if (table["status"] != OK).any():
        notes.append("not implemented = fedcore has no such method yet, so its model cannot be built.")
    return notes


def _grid_cells(table: pd.DataFrame) -> tuple[list[str], list[str], list[list[str]]]:
    """Layout ``grid`` (FedHPL Table 7): rows = `method`, columns = `architecture`, each cell 'ours (paper; Δ)' as
    exact counts (the paper's converted from its rounded unit, so |Δ| up to half that unit is rounding)."""
    rows = list(dict.fromkeys(table["method"]))
    cols = list(dict.fromkeys(table["architecture"]))
    grid = [[NO_PAPER] * len(cols) for _ in rows]
    for r in table.itertuples():
        ours = f"{int(r.trainable):,}" if r.status == OK else r.status
        paper = NO_PAPER if pd.isna(r.paper) else f"{round(r.paper):,}; Δ {r.diff:+,.0f}"
        grid[rows.index(r.method)][cols.index(r.architecture)] = f"{ours} (paper {paper})"
    return rows, cols, grid


def render_param_markdown(table: pd.DataFrame, table_cfg: dict) -> str:
    """The paper's transposed layout (or the ``grid`` layout) as a pipe table."""
    if table_cfg.get("layout") == "grid":
        rows, cols, grid = _grid_cells(table)
        lines = [f"**{table_cfg.get('caption', '')}**", "", "| Method | " + " | ".join(cols) + " |",
                 "|---|" + "---:|" * len(cols)]
        lines += [f"| {r} | " + " | ".join(cells) + " |" for r, cells in zip(rows, grid)]
        lines.append("")
        lines.extend(f"{n}  " for n in footnotes(table, grid=True))
        return "\n".join(lines).rstrip() + "\n"
    cells, best = _cells(table), _best(table)
    lines = [f"**{table_cfg.get('caption', '')}**", ""]
    lines.append("| Method | " + " | ".join(table["method"]) + " |")
    lines.append("|---|" + "---:|" * len(table))
    for label, texts in cells.items():
        if label == "# Parameters ↓ (ours)":
            texts = [f"**{t}**" if b else t for t, b in zip(texts, best)]
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    lines.append("")
    lines.extend(f"{n}  " for n in footnotes(table))
    return "\n".join(lines).rstrip() + "\n"


def render_param_latex(table: pd.DataFrame, table_cfg: dict, label: str | None = None) -> str:
    """The same layout as a booktabs tabular."""
    cells, best = _cells(table), _best(table)
    lines = [r"\begin{table}[htbp]", r"\centering", rf"\caption{{{latex_escape(table_cfg.get('caption', ''))}}}"]
    if label:
        lines.append(rf"\label{{tab:{latex_escape(label)}}}")
    if table_cfg.get("layout") == "grid":
        rows, cols, grid = _grid_cells(table)
        lines += [r"\resizebox{\linewidth}{!}{%", r"\begin{tabular}{l" + "r" * len(cols) + "}", r"\toprule",
                  " & ".join(["Method"] + [latex_escape(c) for c in cols]) + r" \\", r"\midrule"]
        lines += [" & ".join([latex_escape(r)] + [latex_escape(c) for c in cells]) + r" \\"
                  for r, cells in zip(rows, grid)]
        lines += [r"\bottomrule", r"\end{tabular}}", r"\par\smallskip", r"{\footnotesize",
                  " \\\\\n".join(latex_escape(n) for n in footnotes(table, grid=True)), "}", r"\end{table}"]
        return "\n".join(lines) + "\n"
    lines += [r"\begin{tabular}{l" + "r" * len(table) + "}", r"\toprule"]
    lines.append(" & ".join(["Method"] + [latex_escape(m) for m in table["method"]]) + r" \\")
    lines.append(r"\midrule")
    for name, texts in cells.items():
        texts = [latex_escape(t) for t in texts]
        if name == "# Parameters ↓ (ours)":
            texts = [rf"\textbf{{{t}}}" if b else t for t, b in zip(texts, best)]
        lines.append(" & ".join([latex_escape(name).replace("↓", r"$\downarrow$")] + texts) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\par\smallskip", r"{\footnotesize"]
    lines.append(" \\\\\n".join(latex_escape(n) for n in footnotes(table)))
    lines += ["}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def write_param_table(table: pd.DataFrame, table_cfg: dict, out_md: str | os.PathLike, out_tex: str | os.PathLike,
                      out_csv: str | os.PathLike) -> None:
    """Write Markdown, LaTeX and CSV; all three are rendered before any is renamed into place."""
    texts = {
        Path(out_md): render_param_markdown(table, table_cfg),
        Path(out_tex): render_param_latex(table, table_cfg, label=Path(out_tex).stem),
        Path(out_csv): exact_resolution(table).to_csv(index=False, float_format="%.6g", lineterminator="\n"),
    }
    with contextlib.ExitStack() as stack:
        tmps = {path: stack.enter_context(atomic_path(path)) for path in texts}
        for path, text in texts.items():
            tmps[path].write_text(text, encoding="utf-8")
