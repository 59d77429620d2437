"""A paper's run inventory for the report: which configured runs have metrics (complete or not) and which are
missing, at the scale being built, and which table cells have no number and why.

The CSV has one row per configured run:

    experiment, method, seed, scale     the run
    status               present | incomplete (its last round is before the configured one) | missing |
                         not selected (configured, but no output the config's `outputs` picks reads it)
    rounds_configured    the run's budget (the method's own where it has one)
    last_round           the last round with a metric row (<NA> when missing)
    evaluated_rounds     rounds with an evaluation row (split global or local)
    diverged_from        the first round whose trained state held NaN or inf (the engine's `diverged` rows;
                         <NA> for a healthy run): its numbers are marked ! in the tables
"""
from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

import pandas as pd

from fedcore.io import atomic_path
from fedcore.metrics import DIVERGED
from fedcore.report.html_pages import page, paper_title, scale_caption

PRESENT, INCOMPLETE, MISSING, NOT_SELECTED = "present", "incomplete", "missing", "not selected"
INVENTORY_COLUMNS = ["experiment", "method", "seed", "scale", "status", "rounds_configured", "last_round",
                     "evaluated_rounds", "diverged_from"]


def configured_runs(cfg, paper: str) -> list[dict[str, Any]]:
    """The paper's configured runs at the config's scale: experiment, method, seed, the run's configured rounds
    and whether the chosen outputs read it (``selected``)."""
    return [{**r, "rounds": int(cfg.federation(r["experiment"], r["method"])["rounds"]),
             "selected": cfg.is_selected(r["experiment"], r["method"])}
            for r in cfg.runs(selected_only=False) if cfg.experiments[r["experiment"]]["paper"] == paper]


def unbuilt_outputs(cfg, paper: str) -> list[str]:
    """The paper's tables and figures that the config's `outputs` leaves out."""
    chosen = set(cfg.outputs)
    return [n for n, x in [*cfg.tables.items(), *cfg.figures.items()]
            if x.get("source_paper") == paper and n not in chosen]


def method_labels(cfg, paper: str) -> dict[str, str]:
    """Display labels of methods and variants, as the paper's tables and figures print them (a variant no table
    or figure shows keeps its own ``label``)."""
    out: dict[str, str] = {v: x["label"] for v, x in cfg.variants.items() if "label" in x}
    for entry in [*cfg.tables.values(), *cfg.figures.values()]:
        if entry.get("source_paper") == paper:
            out.update(entry.get("labels") or {})
            out.update(entry.get("row_labels") or {})
    return out


def build_inventory(metrics: pd.DataFrame, runs: list[dict[str, Any]], scale: str) -> pd.DataFrame:
    """One row per configured run with its status (see the module docstring)."""
    metrics = metrics.loc[metrics["scale"] == scale]
    rounds = metrics.groupby(["experiment", "method", "seed"])["round"].max()
    evaluated = (metrics.loc[metrics["split"].isin(["global", "local"])]
                 .groupby(["experiment", "method", "seed"])["round"].nunique())
    diverged = metrics.loc[metrics["metric"] == DIVERGED].groupby(["experiment", "method", "seed"])["round"].min()
    rows = []
    for r in runs:
        key = (r["experiment"], r["method"], int(r["seed"]))
        last = int(rounds[key]) if key in rounds.index else None
        status = (MISSING if r.get("selected", True) else NOT_SELECTED) if last is None \
            else (INCOMPLETE if last < int(r["rounds"]) else PRESENT)
        rows.append({"experiment": key[0], "method": key[1], "seed": key[2], "scale": scale, "status": status,
                     "rounds_configured": int(r["rounds"]), "last_round": last,
                     "evaluated_rounds": int(evaluated.get(key, 0)),
                     "diverged_from": int(diverged[key]) if key in diverged.index else None})
    out = pd.DataFrame(rows, columns=INVENTORY_COLUMNS)
    return out.astype({"seed": "int64", "rounds_configured": "int64", "last_round": "Int64",
                       "evaluated_rounds": "int64", "diverged_from": "Int64"})


def empty_cells(table_csvs: dict[str, str | os.PathLike]) -> pd.DataFrame:
    """Cells of the paper's tables without a number: table, row, column and the reason (the CSV's status)."""
    rows = []
    for name, path in table_csvs.items():
        df = pd.read_csv(path)
        if "status" not in df.columns:
            continue
        row_col = next((c for c in ("row_label", "method", "label") if c in df.columns), None)
        col_col = next((c for c in ("column", "architecture") if c in df.columns), None)
        for r in df.loc[df["status"] != "ok"].itertuples(index=False):
            r = r._asdict()
            rows.append({"table": name, "row": r.get(row_col, ""), "column": r.get(col_col, ""), "reason": r["status"]})
    return pd.DataFrame(rows, columns=["table", "row", "column", "reason"])


def _cell_text(run: pd.Series) -> str:
    """One run's cell in the per-experiment grid."""
    if run["status"] in (MISSING, NOT_SELECTED):
        return run["status"]
    text = f"{run['last_round']}/{run['rounds_configured']} rounds, {run['evaluated_rounds']} evaluated"
    if not pd.isna(run["diverged_from"]):
        text += f", diverged (NaN/inf) from round {run['diverged_from']}"
    return text if run["status"] == PRESENT else f"incomplete: {text}"


def render_inventory_html(inventory: pd.DataFrame, cells: pd.DataFrame, paper: str, scale: str,
                          labels: dict[str, str] | None = None, unbuilt: list[str] | None = None) -> str:
    """The page: a summary line, the outputs not built, one grid per experiment (methods x seeds) and the table
    cells without a number."""
    esc = lambda t: html.escape(str(t), quote=False)  # noqa: E731
    labels = labels or {}
    counts = inventory["status"].value_counts()
    parts = [f"<h1>{esc(paper_title(paper))}: run inventory, scale {esc(scale)}</h1>",
             f'<p class="caption">{len(inventory)} configured runs: {int(counts.get(PRESENT, 0))} present, '
             f"{int(counts.get(INCOMPLETE, 0))} incomplete (last round before the configured one), "
             f"{int(counts.get(MISSING, 0))} missing (no metrics), {int(counts.get(NOT_SELECTED, 0))} not selected "
             f"(no output the config's <code>outputs</code> picks reads them); {int(inventory['diverged_from'].notna().sum())} "
             f"diverged (a NaN or an infinity in the trained state; numbers marked !). {esc(scale_caption(scale))}</p>"]
    if unbuilt:
        parts.append(f"<p>Not built in this run (config <code>outputs</code>; <code>--config outputs=all</code> builds "
                     f"them): {esc(', '.join(unbuilt))}.</p>")
    seeds = sorted(inventory["seed"].unique())
    for exp, grp in inventory.groupby("experiment", sort=False):
        head = "".join(f"<th>seed {s}</th>" for s in seeds)
        body = []
        for method, runs in grp.groupby("method", sort=False):
            by_seed = runs.set_index("seed")
            tds = []
            for s in seeds:
                if s not in by_seed.index:
                    tds.append("<td>—</td>")
                    continue
                run = by_seed.loc[s]
                cls = "" if run["status"] == PRESENT else ' class="missing"'
                tds.append(f"<td{cls}>{esc(_cell_text(run))}</td>")
            name = labels.get(method, method)
            label = esc(name) if name == method else f"{esc(name)} <code>{esc(method)}</code>"
            body.append(f'<tr><td class="label">{label}</td>{"".join(tds)}</tr>')
        parts.append(f"<h2>{esc(exp)}</h2>\n<table><thead><tr><th class=\"label\">method</th>{head}</tr></thead>"
                     f"<tbody>{''.join(body)}</tbody></table>")
    parts.append("<h2>Table cells without a number</h2>")
    if cells.empty:
        parts.append("<p>None: every cell of the paper's tables has a number.</p>")
    else:
        rows = "".join(f'<tr><td class="label">{esc(r.table)}</td><td class="label">{esc(r.row)}</td>'
                       f'<td class="label">{esc(r.column)}</td><td class="label missing">{esc(r.reason)}</td></tr>'
                       for r in cells.itertuples(index=False))
        parts.append('<table><thead><tr><th class="label">table</th><th class="label">row</th>'
                     f'<th class="label">column</th><th class="label">reason</th></tr></thead><tbody>{rows}</tbody></table>')
    return "\n".join(parts)


def write_inventory(metrics_path: str | os.PathLike, runs: list[dict[str, Any]], table_csvs: dict[str, str],
                    paper: str, scale: str, out_html: str | os.PathLike, out_csv: str | os.PathLike,
                    labels: dict[str, str] | None = None, unbuilt: list[str] | None = None) -> None:
    """Read the metrics and the paper's table CSVs; write the inventory page and its CSV atomically."""
    inventory = build_inventory(pd.read_parquet(metrics_path), runs, scale)
    body = render_inventory_html(inventory, empty_cells(table_csvs), paper, scale, labels, unbuilt)
    with atomic_path(Path(out_html)) as h, atomic_path(Path(out_csv)) as c:
        Path(h).write_text(page(f"{paper_title(paper)} run inventory", body), encoding="utf-8")
        Path(c).write_text(inventory.to_csv(index=False, lineterminator="\n"), encoding="utf-8")
