"""The reproduction scorecard of one paper: per scale and table, how many cells are configured, how many have a
run, and at scale paper how many lie within TOLERANCE points of the paper's number, with the largest
differences.

Only tables of kind metrics count (cells read runs); parameter counts and dataset statistics are no runs. A
cell is compared with the paper's number only at scale paper (at mini data and backbone differ), only when
both numbers exist and only for metrics shown in % (points); upload counts (FedHPL Tables 9-10) have a run
but are not compared. The CSV holds both parts, told apart by `section`: "cells" rows (one per scale and
table, plus table "all") and "largest difference" rows (scale paper, largest |ours − paper| first).
"""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from fedcore.io import atomic_path
from fedcore.papers import paper_title
from fedcore.report.tables import (
    MISSING_METRIC, MISSING_RUN, NOT_CONFIGURED, NOT_IMPLEMENTED, NOT_SELECTED, OK, PERCENT, build_table,
    metric_factor,
)

TOLERANCE = 1.5   # points, the "within 1.5 points of the paper's value"
LARGEST = 10      # differences listed
STATUS_COUNTS = {"with_run": OK, "missing_run": MISSING_RUN, "missing_metric": MISSING_METRIC,
                 "not_configured": NOT_CONFIGURED, "not_implemented": NOT_IMPLEMENTED, "not_selected": NOT_SELECTED}
SCORE_COLUMNS = ["section", "scale", "table", "cells", "with_paper", *STATUS_COUNTS, "compared", "within_tol",
                 "row", "column", "ours", "paper", "diff"]


def metric_tables(tables: Mapping[str, dict]) -> dict[str, dict]:
    """The tables whose cells read runs."""
    return {n: t for n, t in tables.items() if t.get("kind", "metrics") == "metrics"}


def _comparable(table: pd.DataFrame) -> pd.Series:
    """Cells with both numbers, in points (percent metrics)."""
    percent = table["metric"].map(lambda m: metric_factor({"metric": m}) == PERCENT)
    return (table["status"] == OK) & table["paper"].notna() & table["ours"].notna() & percent


def table_counts(table: pd.DataFrame, scale: str, tol: float = TOLERANCE) -> dict[str, Any]:
    """Cell counts of one built table; compared and within_tol only at scale paper (NaN otherwise)."""
    out: dict[str, Any] = {"cells": len(table), "with_paper": int(table["paper"].notna().sum())}
    out.update({k: int((table["status"] == s).sum()) for k, s in STATUS_COUNTS.items()})
    if scale == "paper":
        comp = _comparable(table)
        out["compared"] = int(comp.sum())
        out["within_tol"] = int((comp & ((table["ours"] - table["paper"]).abs() <= tol)).sum())
    else:
        out["compared"] = out["within_tol"] = math.nan
    return out


def build_scorecard(views: Mapping[str, Mapping[str, Any]], metrics: pd.DataFrame, tol: float = TOLERANCE,
                    largest: int = LARGEST) -> pd.DataFrame:
    """The scorecard frame (SCORE_COLUMNS) of the tables in `views` (scale -> tables, experiments, implemented)."""
    records, diffs = [], []
    for scale, view in views.items():
        built = {n: build_table(metrics, t, view["experiments"], scale, set(view["implemented"]))
                 for n, t in metric_tables(view["tables"]).items()}
        for name, table in built.items():
            records.append({"section": "cells", "scale": scale, "table": name, **table_counts(table, scale, tol)})
            if scale == "paper":
                comp = table.loc[_comparable(table)]
                diffs += [{"section": "largest difference", "scale": scale, "table": name, "row": r.row_label,
                           "column": r.column, "ours": r.ours, "paper": r.paper, "diff": r.ours - r.paper}
                          for r in comp.itertuples()]
        if built:
            total = table_counts(pd.concat(built.values(), ignore_index=True), scale, tol)
            records.append({"section": "cells", "scale": scale, "table": "all", **total})
    diffs.sort(key=lambda d: -abs(d["diff"]))
    return pd.DataFrame.from_records(records + diffs[:largest], columns=SCORE_COLUMNS)


def _n(x: Any) -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else str(int(x))


def render_scorecard_markdown(card: pd.DataFrame, paper: str, tol: float = TOLERANCE,
                              metrics_scales: set[str] | None = None) -> str:
    """Per scale a table of cell counts; at scale paper the within-tolerance count and the largest differences;
    a scale missing from `metrics_scales` (the scales the metrics hold) is said to have no runs there."""
    lines = [f"# {paper_title(paper)}: reproduction scorecard", "",
             f"Cells of the paper's result tables (kind metrics) per scale: configured, with the paper's number, "
             f"with a run (a number of ours), and why the rest have none. At scale paper, cells with both numbers "
             f"(in %) are compared: within = |ours − paper| <= {tol:g} points. At mini nothing is compared (the "
             "paper's numbers are a layout reference only). 'Not selected': configured, but not run because no "
             "output the config's `outputs` picks reads it (the default builds each paper's headline outputs; "
             "`--config outputs=all` builds all).", ""]
    cells = card.loc[card["section"] == "cells"]
    head = ["table", "cells", "with paper", "with run", "missing run", "missing metric", "not configured",
            "not implemented", "not selected", "compared", f"within {tol:g}"]
    keys = ["cells", "with_paper", *STATUS_COUNTS, "compared", "within_tol"]
    for scale, rows in cells.groupby("scale", sort=False):
        lines += [f"## Scale {scale}", ""]
        if metrics_scales is not None and scale not in metrics_scales:
            lines += [f"results/metrics.parquet holds no run of scale {scale} (it aggregates the runs of the scale "
                      "the pipeline ran).", ""]
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for r in rows.to_dict("records"):
            name = f"**{r['table']}**" if r["table"] == "all" else r["table"]
            lines.append(f"| {name} | " + " | ".join(_n(r[k]) for k in keys) + " |")
        lines.append("")
    diffs = card.loc[card["section"] == "largest difference"]
    if len(diffs):
        lines += [f"## Largest differences (scale paper, top {len(diffs)})", "",
                  "| table | row | column | ours | paper | ours − paper |", "|---|---|---|---:|---:|---:|"]
        lines += [f"| {r.table} | {r.row} | {r.column} | {r.ours:.2f} | {r.paper:.2f} | {r.diff:+.2f} |"
                  for r in diffs.itertuples()]
    elif (cells["scale"] == "paper").any():
        lines.append("No cell at scale paper has both our number and the paper's: nothing to compare yet.")
    return "\n".join(lines).rstrip() + "\n"


def write_scorecard(card: pd.DataFrame, paper: str, out_csv: str | os.PathLike, out_md: str | os.PathLike,
                    metrics_scales: set[str] | None = None) -> None:
    """Write the scorecard as CSV and Markdown, both rendered before either is written (atomic)."""
    texts = {Path(out_csv): card.to_csv(index=False, float_format="%.6g", lineterminator="\n"),
             Path(out_md): render_scorecard_markdown(card, paper, metrics_scales=metrics_scales)}
    with contextlib.ExitStack() as stack:
        tmps = {path: stack.enter_context(atomic_path(path)) for path in texts}
        for path, text in texts.items():
            tmps[path].write_text(text, encoding="utf-8")


def write_paper_scorecard(paper: str, views: Mapping[str, Mapping[str, Any]], metrics_path: str | os.PathLike,
                          out_csv: str | os.PathLike, out_md: str | os.PathLike) -> None:
    """The workflow's entry: read the aggregated metrics, build the paper's scorecard at every scale, write it."""
    metrics = pd.read_parquet(metrics_path)
    write_scorecard(build_scorecard(views, metrics), paper, out_csv, out_md, set(metrics["scale"].unique()))
