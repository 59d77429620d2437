"""The papers' headline claims checked on the built tables: each claim's grid (a built table, or a sweep figure
built as one) filled with our cells; the predicates, layouts and verdict rules are fedcore/claim_rules.py's.
"""
from __future__ import annotations

import math

import pandas as pd

from fedcore.claim_rules import NO_POINT, sweep_layout, value_key
from fedcore.report.tables import build_cell, build_table


def build_sweep_table(metrics: pd.DataFrame, fig_cfg: dict, experiments: dict[str, dict], scale: str,
                      implemented: set[str]) -> pd.DataFrame:
    """A sweep figure's points in build_table's long form (row = setting, column = series label), plus `method`."""
    values, labels, points = sweep_layout(fig_cfg)
    param = fig_cfg.get("param_label", "setting")
    names = fig_cfg.get("labels") or {}
    records = []
    for v in values:
        for j, label in enumerate(labels):
            p = points.get((v, label))
            if p is None:
                cell = {"ours": math.nan, "ours_std": math.nan, "n_seeds": 0, "status": NO_POINT, "method": ""}
            else:
                exp = p.get("experiment", fig_cfg["experiment"])
                cell = build_cell(metrics, p["method"], {"experiment": exp, "metric": p["metric"], "label": label},
                                  experiments[exp], scale, implemented)
                cell["method"] = p["method"]
            method = cell.pop("method")
            row_label = f"{param} = {value_key(v)}" + (f" ({names.get(method, method)})" if method else "")
            records.append({"row": value_key(v), "row_label": row_label, "column": label, "col_index": j,
                            "method": method, "ours": cell["ours"], "ours_std": cell["ours_std"],
                            "n_seeds": cell["n_seeds"], "status": cell["status"], "paper": math.nan})
    return pd.DataFrame.from_records(records)


def claim_grid(claim: dict, tables: dict[str, dict], figures: dict[str, dict], metrics: pd.DataFrame,
               experiments: dict[str, dict], scale: str, implemented: set[str]) -> pd.DataFrame:
    """The long-form cells a claim reads (build_table's frame with a `method` column)."""
    if "table" in claim:
        table = build_table(metrics, tables[claim["table"]], experiments, scale, implemented)
        return table.assign(method=table["row"])
    return build_sweep_table(metrics, figures[claim["figure"]], experiments, scale, implemented)
