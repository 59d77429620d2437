"""FedPFT Tables 1, 4, 5, 8 (table kind ``linear_probe``): cells from the per-run probe CSVs
(``fedcore.analysis.linear_probe``), in the long form of ``fedcore.report.tables`` so that its renderers write them.

A cell reads one (experiment, method, feature, measure): the row's method (or its ``row_sources`` entry: another
method and a feature kind, Table 5's prompt types), the column's experiment and ``measure`` (probe | origin |
match; default probe) and ``feature`` (default: the row source's, else ``default``). Per seed the clients' values
are averaged (unweighted, as the paper's mean client accuracy), then mean ± std (ddof=1) over seeds, in %.
The window is the final round: the probes read each run's final.pt (spec fedpft §1.12a, §8 A13).
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

from fedcore.report.resolution import RESOLUTION_COLUMNS, resolution_columns
from fedcore.report.tables import (MISSING_METRIC, MISSING_RUN, NOT_CONFIGURED, NOT_IMPLEMENTED, OK, PAPER_ROLE,
                                   PERCENT, TABLE_COLUMNS, _paper_numbers, check_scale_and_columns, mean_std)

WINDOW = "final round"
READ_COLUMNS = ["experiment", "method", "scale", "seed", "client", "feature", "measure", "value"]  # what a cell reads


def cell_source(table_cfg: dict, row: str, col: dict) -> tuple[str, str, str]:
    """(method, feature, measure) a cell reads."""
    src = (table_cfg.get("row_sources") or {}).get(row) or {}
    feature = col.get("feature", src.get("feature", "default"))
    return src.get("method", row), feature, col.get("measure", "probe")


def probe_cell(rows: pd.DataFrame, method: str, feature: str, measure: str, experiment: str, exp_cfg: dict,
               scale: str, implemented: set[str]) -> dict[str, Any]:
    """One cell's number (mean over clients per seed, then over seeds, in %) or the reason it has none."""
    cell = {"ours": math.nan, "ours_std": math.nan, "n_seeds": 0}
    run = rows.loc[(rows["experiment"] == experiment) & (rows["method"] == method) & (rows["scale"] == scale)] \
        if len(rows) else rows
    if method not in implemented:
        return {**cell, "status": NOT_IMPLEMENTED}
    if method not in exp_cfg.get("methods", []):
        return {**cell, "status": NOT_CONFIGURED}
    if run.empty:
        return {**cell, "status": MISSING_RUN}
    vals = run.loc[(run["feature"] == feature) & (run["measure"] == measure)].dropna(subset=["value"])
    if vals.empty:
        return {**cell, "status": MISSING_METRIC}
    # a probe CSV written before divergence was recorded has no such column: none known
    diverged = bool(vals["diverged"].astype(bool).any()) if "diverged" in vals.columns else False
    per_seed = vals.groupby("seed")["value"].mean()
    mean, std = mean_std(per_seed)
    first = vals.loc[vals["seed"] == vals["seed"].min()]   # the test images: the first seed's, summed over clients
    n_test = int(first["n_test"].sum()) if "n_test" in first and first["n_test"].notna().all() else None
    return {"ours": PERCENT * mean, "ours_std": PERCENT * std, "n_seeds": len(per_seed), "status": OK,
            "n_test": n_test, "diverged": diverged}


def build_probe_table(rows: pd.DataFrame, table_cfg: dict, experiments: dict[str, dict], scale: str,
                      implemented: set[str]) -> pd.DataFrame:
    """One row per table cell in ``fedcore.report.tables``' long form (client -1, window 'final round')."""
    check_scale_and_columns(table_cfg, experiments, scale)
    labels = table_cfg.get("row_labels") or {}
    records, sizes = [], []
    for row in table_cfg["rows"]:
        paper, paper_std = _paper_numbers(table_cfg, row), _paper_numbers(table_cfg, row, "paper_std")
        for j, col in enumerate(table_cfg["columns"]):
            method, feature, measure = cell_source(table_cfg, row, col)
            cell = probe_cell(rows, method, feature, measure, col["experiment"], experiments[col["experiment"]],
                              scale, implemented)
            n_test = cell.pop("n_test", None)
            sizes.append((n_test, "all clients' test sets (mean of client accuracies)") if n_test
                         else (None, "test set size not in the probe's rows"))
            paper_j = math.nan if paper[j] is None else paper[j]
            records.append({"row": row, "row_label": labels.get(row, row), "column": col["label"], "col_index": j,
                            "experiment": col["experiment"], "metric": f"{measure}:{feature}", "client": -1,
                            "window": WINDOW, **cell, "rounds_used": pd.NA, "short_window": False,
                            "incomplete": False, "untrained": False, "folder_layout": False,
                            "diverged": cell.get("diverged", False), "paper": paper_j,
                            "diff": cell["ours"] - paper_j if scale == "paper" else math.nan,
                            "scale": scale, "paper_role": PAPER_ROLE[scale],
                            "paper_std": math.nan if paper_std[j] is None else paper_std[j]})
    table = pd.DataFrame.from_records(records, columns=TABLE_COLUMNS[:-len(RESOLUTION_COLUMNS)])
    table = table.astype({"col_index": "int64", "client": "int64", "n_seeds": "int64", "rounds_used": "Int64",
                          "ours": "float64", "ours_std": "float64", "paper": "float64", "diff": "float64",
                          "paper_std": "float64", "short_window": "bool", "incomplete": "bool", "untrained": "bool",
                          "folder_layout": "bool", "diverged": "bool"})
    return resolution_columns(table, sizes, int(table_cfg.get("decimals", 2)))


def read_probe_rows(paths) -> pd.DataFrame:
    """The per-run probe CSVs concatenated (an empty frame of the probe's columns when there are none)."""
    paths = [paths] if isinstance(paths, str) else list(paths or [])
    frames = [pd.read_csv(p) for p in paths]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=READ_COLUMNS)
