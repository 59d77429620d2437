"""Build the papers' tables from the aggregated metrics and write them as Markdown, LaTeX and CSV.

`build_table` returns one row per table cell (long form), in table order (rows, then columns):

    row, row_label        method key and its display label
    column, col_index     the column's label and 0-based position
    experiment, metric, client, window    what the cell measures (client -1 = aggregate over clients);
                          window is the experiment's report window, or the column's `round`
                          (first | last | a round number) where it names one
    ours, ours_std        our number in the metric's unit (accuracies in %; METRIC_UNITS) (mean over
                          seeds of each seed's windowed value; std over seeds with ddof=1, NaN with one
                          seed); NaN when there is no number. A `client_acc` column with `clients: [...]`
                          (FedOTP Table A3: a domain's clients) instead gives the mean and the std (ddof=0,
                          as the official code's np.std) over those clients of each client's accuracy
                          (its windowed value, averaged over seeds)
    std_over              what ours_std spreads over: seeds, or clients (a `clients` column)
    n_seeds               seeds behind `ours` (0 when none)
    rounds_used           fewest evaluated rounds any seed contributed to its window (<NA> if none)
    short_window          some seed had fewer evaluated rounds than the window needs (marked †)
    incomplete            some seed's run ended before the experiment's configured rounds (marked ‡)
    untrained             the window's aggregate counted clients never sampled yet, scored with their initial
                          personalised model (e.g. a random head) (marked §); evaluation.untrained_clients:
                          exclude leaves them out instead
    folder_layout         the experiment's dataset was built from image folders with our own train/test split,
                          not the FedBN pickles (allow_folder_layout; marked ¶)
    diverged              some seed's run held a NaN or an infinity in its trained state at some round (the
                          engine's `diverged` rows, fedcore/engine/health.py; marked !)
    paper                 the paper's number in % (NaN = the paper has no such cell)
    diff                  ours − paper in the metric's unit; only at scale 'paper', NaN otherwise
    status                ok | not implemented | not configured | missing run | missing metric | not selected
    scale, paper_role     the scale, and 'target' (paper) or 'layout reference only' (mini)
    paper_std, std_over   the paper's std (FedPFT), and what ours_std spreads over
    test_images, test_images_of, step, ci95_low, ci95_high, interval, degenerate
                          the cell's resolution (fedcore/report/resolution.py): the test images behind the number
                          and which set they are, one image in points, the Wilson 95 % interval (in %) of a
                          single-seed accuracy, how the cell's spread is given, and its column's flag when every
                          number of the column is 0 or all are equal

The CSV written by `write_table` is exactly this frame, so it stays machine-readable.
"""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from fedcore.io import atomic_path
from fedcore.metrics import DIVERGED
from fedcore.report import table_notes
from fedcore.report.html_pages import SCALE_BANNERS, page
from fedcore.report.resolution import (NOT_A_PROPORTION, RESOLUTION_COLUMNS, EvalSizes, cell_test_images,
                                       resolution_columns)
# a cell's status: why it has no number (selection.py says which run each cell reads)
from fedcore.selection import (MISSING_METRIC, MISSING_RUN, NOT_CONFIGURED, NOT_IMPLEMENTED, NOT_SELECTED, OK,
                               row_source)


SHORT_MARK = "†"
INCOMPLETE_MARK = "‡"
UNTRAINED_MARK = "§"
FOLDER_MARK = "¶"
DIVERGED_MARK = "!"
NO_PAPER = "—"

# Table metric shorthand -> (split, client, metric) in the long-form metrics.
METRIC_KEYS: dict[str, tuple[str, int, str]] = {
    "global_acc": ("global", -1, "acc"),
    # personalised methods: the lowest / highest client's own model on the global test set
    "global_acc_min": ("global", -1, "acc_min"),
    "global_acc_max": ("global", -1, "acc_max"),
    "local_acc": ("local", -1, "acc_mean"),
    "worst_local_acc": ("local", -1, "acc_worst"),
    # Hungarian accuracy of SGPT's Select groups vs. the coarse labels (SGPT Table 4), written by sgpt runs
    "select_cluster_acc": ("global", -1, "select_cluster_acc"),
    # what the clients sent (the engine counts every uplink): the mean per client and the round's total
    "upload_numbers": ("train", -1, "upload_numbers_mean"),
    "upload_total_M": ("train", -1, "upload_numbers_total"),
    # mean training losses over the round's clients (FedPFT Fig. 5: L_CE and L_Con, logged by its Strategy.train_metrics)
    "train_ce": ("train", -1, "ce"),
    "train_con": ("train", -1, "con"),
}

# A metric's factor from the logged value to the table's unit (default: a fraction shown in %).
METRIC_UNITS: dict[str, float] = {
    "upload_numbers": 1.0,
    "upload_total_M": 2.0 ** -20,   # FedHPL Table 10 counts in M = 2^20 numbers
    "train_ce": 1.0,
    "train_con": 1.0,
}
PERCENT = 100.0

PAPER_ROLE = {"paper": "target", "mini": "layout reference only (data and backbone differ)",
              "smoke": "layout reference only (synthetic data: not results)"}

MINI_NOTE = (
    "Scale mini: our numbers come from the embedded analogue datasets and a tiny pretrained backbone; "
    "the paper's numbers are a reference for layout only (data and backbone differ), "
    "so no difference is computed."
)
PAPER_NOTE = "Scale paper: Δ = ours − paper, in percentage points."
SMOKE_NOTE = ("Scale smoke: the paper's setup for one round on synthetic data (random weights where a weight file is "
              "missing); the paper's numbers are a reference for layout only, so no difference is computed.")

STATUS_NOTES = {
    NOT_IMPLEMENTED: "not implemented = fedcore has no such method yet",
    NOT_CONFIGURED: "not configured = the method is not in the experiment's methods",
    MISSING_RUN: "missing run = configured, but no metrics were found for it",
    MISSING_METRIC: "missing metric = the run exists but never wrote this metric",
    NOT_SELECTED: ("not selected = configured, but not run: no output the config's `outputs` picks reads it "
                   "(`--config outputs=all` runs every configured run)"),
}

TABLE_COLUMNS = [
    "row", "row_label", "column", "col_index", "experiment", "metric", "client", "window",
    "ours", "ours_std", "n_seeds", "rounds_used", "short_window", "incomplete", "untrained",
    "folder_layout", "diverged", "paper", "diff", "status", "scale", "paper_role", "paper_std", "std_over",
    *RESOLUTION_COLUMNS,
]


# ----------------------------------------------------------------------------------------------
# Numbers
# ----------------------------------------------------------------------------------------------

def metric_key(col: dict) -> tuple[str, int, str]:
    """Map a table column's metric shorthand to (split, client, metric)."""
    name = col["metric"]
    if name == "client_acc":
        if ("client" in col) == ("clients" in col):
            raise ValueError(f"column {col.get('label')!r}: metric client_acc needs a 'client' key or a 'clients' "
                             "list (mean ± std over them), not both")
        return ("local", int(col["client"]) if "client" in col else -1, "acc")
    if name not in METRIC_KEYS:
        raise ValueError(f"column {col.get('label')!r}: unknown metric {name!r}; "
                         f"expected one of {sorted(METRIC_KEYS) + ['client_acc']}")
    return METRIC_KEYS[name]


def column_clients(col: dict) -> list[int] | None:
    """The clients a ``client_acc`` column aggregates (mean ± std over them), or None for one-number columns."""
    clients = col.get("clients")
    if clients is None:
        return None
    if col["metric"] != "client_acc" or not clients or any(isinstance(c, bool) or not isinstance(c, int) or c < 0
                                                           for c in clients):
        raise ValueError(f"column {col.get('label')!r}: 'clients' must be a non-empty list of client indices "
                         f"with metric client_acc, got {clients!r} with metric {col['metric']!r}")
    return [int(c) for c in clients]


def check_report(report: dict) -> tuple[str, int | None]:
    """Validate an experiment's report block and return (window, rounds)."""
    window = report.get("window")
    if window == "best":
        return "best", None
    if window == "last":
        rounds = report.get("rounds")
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
            raise ValueError(f"report window 'last' needs an integer rounds >= 1, got {rounds!r}")
        return "last", rounds
    raise ValueError(f"unknown report window {window!r}; expected 'last' or 'best'")


def metric_factor(col: dict) -> float:
    """From a column's logged value to the table's unit: 100 (a fraction shown in %) unless METRIC_UNITS says."""
    return METRIC_UNITS.get(col["metric"], PERCENT)


def check_round(col: dict) -> str | int | None:
    """A column's fixed round (``round: first | last | <int >= 1>``) instead of the report window, or None."""
    which = col.get("round")
    if which is None or which in ("first", "last") or (isinstance(which, int) and not isinstance(which, bool)
                                                         and which >= 1):
        return which
    raise ValueError(f"column {col.get('label')!r}: round {which!r}; expected first, last or a round number >= 1")


def round_value(per_round: pd.Series, which: str | int) -> tuple[float, int, bool] | None:
    """One seed's value at a fixed round (first / last evaluated, or that round), or None when it has none."""
    per_round = per_round.sort_index()
    if which == "first":
        return float(per_round.iloc[0]), 1, False
    if which == "last":
        return float(per_round.iloc[-1]), 1, False
    if which not in per_round.index:
        return None
    return float(per_round.loc[which]), 1, False


def describe_round(which: str | int) -> str:
    """The window text of a fixed-round column, e.g. 'round 10'."""
    return {"first": "first round", "last": "final round"}.get(which, f"round {which}")  # type: ignore[arg-type]


def describe_window(report: dict) -> str:
    """Human-readable window, e.g. 'last 10' or 'best'."""
    window, rounds = check_report(report)
    return "best" if window == "best" else f"last {rounds}"


def window_value(per_round: pd.Series, report: dict) -> tuple[float, int, bool]:
    """Windowed value of one seed's per-round series: (value, rounds used, window was short)."""
    window, rounds = check_report(report)
    per_round = per_round.sort_index()
    if window == "best":
        return float(per_round.max()), len(per_round), False
    tail = per_round.iloc[-rounds:]
    # Fewer evaluated rounds than the window: use what exists, but say so (flag), never pad.
    return float(tail.mean()), len(tail), len(tail) < rounds


def seed_values(rows: pd.DataFrame, report: dict, which: str | int | None = None) -> pd.DataFrame:
    """Per-seed windowed values (value, rounds_used, short) from one cell's metric rows; with `which`, the
    value at that fixed round (a seed without that round contributes nothing)."""
    out = []
    for seed, grp in rows.groupby("seed", sort=True):
        if grp["round"].duplicated().any():
            raise ValueError(f"seed {seed}: more than one value per round for "
                             f"{grp.iloc[0][['experiment', 'method', 'split', 'client', 'metric']].to_dict()}")
        per_round = grp.set_index("round")["value"]
        got = window_value(per_round, report) if which is None else round_value(per_round, which)
        if got is None:
            continue
        value, used, short = got
        out.append({"seed": seed, "value": value, "rounds_used": used, "short": short})
    return pd.DataFrame(out, columns=["seed", "value", "rounds_used", "short"])


def mean_std(values: pd.Series) -> tuple[float, float]:
    """Mean and sample std (ddof=1) over seeds; std is NaN with a single seed."""
    values = values.astype(float)
    std = float(values.std(ddof=1)) if len(values) > 1 else math.nan
    return float(values.mean()), std


def _incomplete(run: pd.DataFrame, experiment: dict, method: str | None = None) -> bool:
    """True when some seed's run ends before its configured number of rounds (the method's own budget if it has
    one: ``method_rounds`` of Resolved.report_view())."""
    # Resolved.report_view() carries `rounds`; a full experiment dict carries federation.rounds
    rounds = experiment.get("rounds", (experiment.get("federation") or {}).get("rounds"))
    rounds = (experiment.get("method_rounds") or {}).get(method, rounds)
    if rounds is None:
        return False
    last = run.groupby("seed")["round"].max()
    return bool((last < int(rounds)).any())


# ----------------------------------------------------------------------------------------------
# build_table
# ----------------------------------------------------------------------------------------------

def _paper_numbers(table_cfg: dict, row: str, key: str = "paper") -> list[float | None]:
    """The paper's numbers for one row, one per column (None = no such cell); ``key`` paper_std: their stds."""
    n_cols = len(table_cfg["columns"])
    values = (table_cfg.get(key) or {}).get(row)
    if values is None:
        return [None] * n_cols
    if len(values) != n_cols:
        raise ValueError(f"{key} row {row!r} has {len(values)} numbers for {n_cols} columns")
    return [None if v is None else float(v) for v in values]


def run_rows(metrics: pd.DataFrame, experiment: str, exp_cfg: dict, method: str, scale: str) -> pd.DataFrame:
    """All metric rows of one (experiment, method, scale), all seeds."""
    mask = (metrics["experiment"] == experiment) & (metrics["method"] == method) & (metrics["scale"] == scale)
    if "paper" in exp_cfg:
        mask &= metrics["paper"] == exp_cfg["paper"]
    return metrics.loc[mask]


def cell_status(method: str, exp_cfg: dict, run: pd.DataFrame, rows: pd.DataFrame,
                implemented: set[str]) -> str:
    """Why a cell has (or lacks) a number."""
    if method not in implemented:
        return NOT_IMPLEMENTED
    if method not in exp_cfg.get("methods", []):
        return NOT_CONFIGURED
    if run.empty:
        return NOT_SELECTED if method in exp_cfg.get("not_selected", []) else MISSING_RUN
    if rows.empty:
        return MISSING_METRIC
    return OK


def build_cell(metrics: pd.DataFrame, method: str, col: dict, exp_cfg: dict, scale: str,
               implemented: set[str]) -> dict[str, Any]:
    """Compute one cell: our number (or the reason there is none) and its provenance."""
    split, client, metric = metric_key(col)
    which = check_round(col)
    clients = column_clients(col)
    run = run_rows(metrics, col["experiment"], exp_cfg, method, scale)
    rows = run.loc[(run["split"] == split) & (run["metric"] == metric)
                   & (run["client"].isin(clients) if clients else run["client"] == client)]
    if isinstance(which, int):
        rows = rows.loc[rows["round"] == which]
    cell: dict[str, Any] = {
        "experiment": col["experiment"], "metric": col["metric"], "client": client,
        "window": describe_window(exp_cfg["report"]) if which is None else describe_round(which),
        "ours": math.nan, "ours_std": math.nan,
        "n_seeds": 0, "rounds_used": pd.NA, "short_window": False, "incomplete": False, "untrained": False,
        "folder_layout": bool(exp_cfg.get("folder_layout", False)), "diverged": False,
        "status": cell_status(method, exp_cfg, run, rows, implemented),
        "std_over": "clients" if clients else "seeds",
    }
    if cell["status"] != OK:
        return cell
    if clients:
        per_client = {c: seed_values(rows.loc[rows["client"] == c], exp_cfg["report"], which) for c in clients}
        if any(v.empty for v in per_client.values()):  # a listed client without a value: no number, never a
            cell["status"] = MISSING_METRIC            # mean over fewer clients than the column says
            return cell
        values = pd.Series([v["value"].mean() for v in per_client.values()], dtype=float)
        mean, std = float(values.mean()), float(values.std(ddof=0))
        per_seed = pd.concat(per_client.values())
        n_seeds = min(len(v) for v in per_client.values())
    else:
        per_seed = seed_values(rows, exp_cfg["report"], which)
        mean, std = mean_std(per_seed["value"])
        n_seeds = len(per_seed)
    factor = metric_factor(col)
    cell.update(
        ours=factor * mean, ours_std=factor * std, n_seeds=n_seeds,
        rounds_used=int(per_seed["rounds_used"].min()), short_window=bool(per_seed["short"].any()),
        incomplete=_incomplete(run, exp_cfg, method), untrained=_untrained(run, exp_cfg["report"], which),
        diverged=bool((run["metric"] == DIVERGED).any()),
    )
    return cell


def _untrained(run: pd.DataFrame, report: dict, which: str | int | None) -> bool:
    """True when some seed's aggregate over the cell's rounds counted never-sampled clients (an evaluated round of
    the window with ``untrained_clients`` > 0; a ``best`` window is flagged when any evaluated round had some)."""
    rows = run.loc[(run["split"] == "local") & (run["client"] == -1) & (run["metric"] == "untrained_clients")]
    if rows.empty:
        return False
    if report.get("window") == "best" and which is None:
        return bool((rows["value"] > 0).any())
    return bool((seed_values(rows, report, which)["value"] > 0).any())


def check_scale_and_columns(table_cfg: dict, experiments: dict[str, dict], scale: str) -> None:
    """Fail on an unknown scale or a column naming an unknown experiment, before any work."""
    if scale not in PAPER_ROLE:
        raise ValueError(f"unknown scale {scale!r}; expected one of {sorted(PAPER_ROLE)}")
    for col in table_cfg["columns"]:
        if col["experiment"] not in experiments:
            raise ValueError(f"column {col.get('label')!r}: unknown experiment {col['experiment']!r}")


def build_table(metrics: pd.DataFrame, table_cfg: dict, experiments: dict[str, dict], scale: str,
                implemented_methods: set[str], test_sizes: dict[str, EvalSizes | None] | None = None
                ) -> pd.DataFrame:
    """One row per table cell, in table order, with our number, the paper's, the diff, a status and the
    resolution columns (``test_sizes`` per experiment; without them the cells say the size is not known)."""
    check_scale_and_columns(table_cfg, experiments, scale)
    for col in table_cfg["columns"]:
        metric_key(col)  # fail on a bad metric, client list or round before any work
        column_clients(col)
        check_round(col)
        check_report(experiments[col["experiment"]].get("report") or {})
    labels = table_cfg.get("row_labels") or {}
    records, clients_of = [], []
    for row in table_cfg["rows"]:
        paper, paper_std = _paper_numbers(table_cfg, row), _paper_numbers(table_cfg, row, "paper_std")
        for j, col in enumerate(table_cfg["columns"]):
            method, col = row_source(table_cfg, row, col)
            clients_of.append(column_clients(col))
            cell = build_cell(metrics, method, col, experiments[col["experiment"]], scale, implemented_methods)
            paper_j = math.nan if paper[j] is None else paper[j]
            diff = cell["ours"] - paper_j if scale == "paper" else math.nan
            records.append({"row": row, "row_label": labels.get(row, row), "column": col["label"],
                            "col_index": j, **cell, "paper": paper_j, "diff": diff,
                            "scale": scale, "paper_role": PAPER_ROLE[scale],
                            "paper_std": math.nan if paper_std[j] is None else paper_std[j]})
    table = pd.DataFrame.from_records(records, columns=TABLE_COLUMNS[:-len(RESOLUTION_COLUMNS)])
    table = table.astype({"col_index": "int64", "client": "int64", "n_seeds": "int64",
                          "rounds_used": "Int64", "ours": "float64", "ours_std": "float64",
                          "paper": "float64", "diff": "float64", "paper_std": "float64", "short_window": "bool",
                          "incomplete": "bool", "untrained": "bool", "folder_layout": "bool", "diverged": "bool"})
    sizes = [cell_test_images(c.metric, c.client, clients, (test_sizes or {}).get(c.experiment))
             if metric_factor({"metric": c.metric}) == PERCENT else (None, NOT_A_PROPORTION)
             for c, clients in zip(table.itertuples(), clients_of, strict=True)]
    return resolution_columns(table, sizes, int(table_cfg.get("decimals", 2)))


# ----------------------------------------------------------------------------------------------
# Rendering (plain text with Unicode marks; the LaTeX renderer translates them)
# ----------------------------------------------------------------------------------------------

def _fmt(x: float, signed: bool = False, decimals: int = 2) -> str:
    """A number with `decimals` decimals (2 unless the table says), or the no-number dash."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return NO_PAPER
    return f"{x:+.{decimals}f}" if signed else f"{x:.{decimals}f}"


def _typical_seeds(table: pd.DataFrame) -> int:
    """The most common seed count among cells with a number (0 if none)."""
    counts = table.loc[table["status"] == OK, "n_seeds"]
    return int(counts.mode().max()) if len(counts) else 0


def _best_mask(table: pd.DataFrame, table_cfg: dict | None = None) -> pd.Series:
    """Cells holding the best of our numbers in their column (``best_in: row``: in their row; ties all count;
    compared as shown); the table's ``best`` says whether the highest (default), the lowest or none is best."""
    cfg = table_cfg or {}
    how = cfg.get("best", "max")
    if how == "none":
        return pd.Series(False, index=table.index)
    shown = table["ours"].round(int(cfg.get("decimals", 2)))
    best = shown.groupby(table["row" if cfg.get("best_in") == "row" else "col_index"]).transform(how)
    return (table["status"] == OK) & (shown == best)


#: the marks a cell's number may carry, in the order shown: (mark, the cell's flag, what it says: the tables' and
#: the figures' notes)
CELL_MARKS: tuple[tuple[str, str, str], ...] = (
    (SHORT_MARK, "short_window",
     "fewer evaluated rounds than the report window needs; mean over the rounds that exist"),
    (INCOMPLETE_MARK, "incomplete", "a run ended before the experiment's configured number of rounds"),
    (UNTRAINED_MARK, "untrained",
     "the aggregate counts clients never sampled by then, each scored with its initial personalised model "
     "(evaluation.untrained_clients: exclude leaves them out)"),
    (FOLDER_MARK, "folder_layout",
     "the dataset was built from image folders with our own stratified 80/20 train/test split "
     "(allow_folder_layout: true), not the FedBN pickles the papers used"),
    (DIVERGED_MARK, "diverged",
     "a run's trained state held NaN or inf from some round on (it trained on, as the papers' code does): "
     "its number scores a diverged model"),
)


def cell_marks(cell: Mapping[str, Any]) -> str:
    """The marks of a cell with a number (CELL_MARKS), '' for none."""
    return "".join(mark for mark, flag, _ in CELL_MARKS if bool(cell.get(flag, False)))


def mark_notes(marks: str) -> list[str]:
    """One note per mark present in ``marks``, in CELL_MARKS' order."""
    return [f"{mark} {says}." for mark, _, says in CELL_MARKS if mark in marks]


def ours_text(cell: pd.Series, typical_seeds: int, decimals: int = 2) -> str:
    """Our number as shown: 'mean ± std' plus marks, or the reason there is none."""
    if cell["status"] != OK:
        return cell["status"]
    text = _fmt(cell["ours"], decimals=decimals)
    if not math.isnan(cell["ours_std"]):
        text += f" ± {cell['ours_std']:.{decimals}f}"
    if cell["n_seeds"] != typical_seeds:
        text += f" (n={cell['n_seeds']})"
    return text + cell_marks(cell)


def _subheaders(scale: str) -> list[str]:
    """Sub-columns under each table column."""
    # At mini the paper's numbers are only a layout reference, so the header says so and there is no Δ.
    return ["ours", "paper", "Δ"] if scale == "paper" else ["ours", "paper (layout ref.)"]


def _cell_texts(cell: pd.Series, scale: str, typical: int, bold: bool, decimals: int = 2) -> list[tuple[str, bool]]:
    """The (text, bold) entries one table cell expands to."""
    paper = _fmt(cell["paper"], decimals=decimals)
    if not math.isnan(cell.get("paper_std", math.nan)):  # FedPFT's tables print mean ± std over 3 seeds
        paper += f" ± {cell['paper_std']:.{decimals}f}"
    out = [(ours_text(cell, typical, decimals), bold), (paper, False)]
    if scale == "paper":
        out.append((_fmt(cell["diff"], signed=True, decimals=decimals), False))
    return out


def _grid(table: pd.DataFrame, scale: str, table_cfg: dict | None = None
          ) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    """Row labels and, per row, the flat list of (text, bold) entries."""
    typical = _typical_seeds(table)
    best = _best_mask(table, table_cfg)
    decimals = int((table_cfg or {}).get("decimals", 2))
    labels, grid = [], []
    for _, cells in table.groupby("row", sort=False):
        labels.append(str(cells["row_label"].iloc[0]))
        entries: list[tuple[str, bool]] = []
        for idx, cell in cells.sort_values("col_index").iterrows():
            entries.extend(_cell_texts(cell, scale, typical, bool(best.loc[idx]), decimals))
        grid.append(entries)
    return labels, grid


def _row_attributes(table_cfg: dict, table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Extra text columns left of the numbers (e.g. Table 3's check marks): headers and one list per row."""
    attrs = table_cfg.get("row_attributes")
    if not attrs:
        return [], [[] for _ in table["row"].drop_duplicates()]
    blank = [""] * len(attrs["columns"])
    return list(attrs["columns"]), [list(attrs["values"].get(r, blank)) for r in table["row"].drop_duplicates()]


def _column_labels(table: pd.DataFrame) -> list[str]:
    """The table's column labels in order."""
    return list(table.drop_duplicates("col_index").sort_values("col_index")["column"])


def footnotes(table: pd.DataFrame, scale: str, table_cfg: dict | None = None) -> list[str]:
    """Notes printed under the table: seeds, windows, marks and empty-cell reasons that occur."""
    notes = []
    typical = _typical_seeds(table)
    over_clients = table.get("std_over", pd.Series("seeds", index=table.index)) == "clients"
    if typical > 1:
        notes.append(f"Ours: mean ± std over seeds, n = {typical} seeds per cell unless marked (n=k)"
                     + (", except as said below." if over_clients.any() else "."))
    elif typical == 1:
        notes.append("Ours: one seed per cell (no std over seeds) unless marked (n=k).")
    if over_clients.any():
        cols = ", ".join(table.loc[over_clients, "column"].drop_duplicates())
        notes.append(f"Columns {cols}: mean ± std over the column's clients (std ddof=0, as the official code's "
                     "np.std) of each client's accuracy, averaged over seeds first.")
    cfg = table_cfg or {}
    if table_notes.round_note(cfg):
        notes.append(table_notes.round_note(cfg))
    cells = table.drop_duplicates(["experiment", "window"])
    windows = cells.groupby("window", sort=False)["experiment"].apply(list)
    for window, exps in windows.items():
        if window == "best":
            what = "best round"
        elif window == "last 1":
            what = "value at the final evaluated round"
        elif window.startswith("last "):
            what = f"mean of the {window} evaluated rounds"
        else:
            what = f"value at the {window}"
        notes.append(f"Report window ({', '.join(exps)}): {what} of each seed's run.")
    if "test_images" in table:
        notes += table_notes.resolution_notes(table) + table_notes.degenerate_notes(table)
    notes += table_notes.identical_notes(table, cfg)
    if table["paper"].isna().any():
        notes.append(f"{NO_PAPER} = the paper reports no such cell.")
    notes += mark_notes("".join(mark for mark, flag, _ in CELL_MARKS if flag in table and table[flag].any()))
    present = [s for s in STATUS_NOTES if (table["status"] == s).any()]
    if present:
        notes.append("Cells without a number: " + "; ".join(STATUS_NOTES[s] for s in present) + ".")
    how = (table_cfg or {}).get("best", "max")
    if (table["status"] == OK).any() and how != "none":
        where = "row" if (table_cfg or {}).get("best_in") == "row" else "column"
        notes.append(f"Bold = best of our numbers in the {where}" + (" (the lowest)." if how == "min" else "."))
    return notes


def _percent_only(table: pd.DataFrame) -> bool:
    """True when every column's metric is shown in % (accuracies)."""
    return all(metric_factor({"metric": m}) == PERCENT for m in table["metric"].unique())


def scale_banner(scale: str | None) -> str | None:
    """The line every table and figure of ``scale`` must carry (smoke: synthetic data, not results), or None."""
    return SCALE_BANNERS.get(scale)


def scale_note(scale: str, percent: bool = True) -> str:
    """The caption sentence that says how to read the paper's numbers at this scale."""
    if scale == "mini":
        return MINI_NOTE
    if scale == "smoke":
        return SMOKE_NOTE
    return PAPER_NOTE if percent else "Scale paper: Δ = ours − paper, in the table's units."


def _md_escape(text: str) -> str:
    """Escape the Markdown pipe-table separator."""
    return text.replace("|", "\\|")


def render_markdown(table: pd.DataFrame, table_cfg: dict, scale: str) -> str:
    """A pipe table with the caption (and the scale note) on top and the footnotes below."""
    subs = _subheaders(scale)
    attr_cols, attr_rows = _row_attributes(table_cfg, table)
    header = [table_cfg.get("row_header", "Method")] + attr_cols + [f"{c}: {s}" for c in _column_labels(table) for s in subs]
    labels, grid = _grid(table, scale, table_cfg)
    lines = [f"**{table_cfg.get('caption', '')}** {scale_note(scale, _percent_only(table))}", ""]
    lines.append("| " + " | ".join(_md_escape(h) for h in header) + " |")
    lines.append("|" + "|".join(["---"] + [":---:"] * len(attr_cols) + ["---:"] * (len(header) - 1 - len(attr_cols))) + "|")
    for label, attrs, entries in zip(labels, attr_rows, grid):
        texts = [f"**{_md_escape(t)}**" if b else _md_escape(t) for t, b in entries]
        lines.append("| " + " | ".join([_md_escape(label)] + [_md_escape(a) for a in attrs] + texts) + " |")
    lines.append("")
    lines.extend(f"{note}  " for note in footnotes(table, scale, table_cfg))
    return "\n".join(lines).rstrip() + "\n"


_TEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
                "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
_TEX_UNICODE = {"±": r"$\pm$", "—": "---", "−": "$-$", "Δ": r"$\Delta$", "✓": r"$\checkmark$",
                SHORT_MARK: r"$^{\dagger}$", INCOMPLETE_MARK: r"$^{\ddagger}$", UNTRAINED_MARK: r"\S{}",
                FOLDER_MARK: r"\P{}"}


def latex_escape(text: str) -> str:
    """Escape LaTeX specials, then map the Unicode marks we use to LaTeX commands."""
    out = "".join(_TEX_SPECIAL.get(ch, ch) for ch in text)
    for uni, tex in _TEX_UNICODE.items():
        out = out.replace(uni, tex)
    return out


def render_latex(table: pd.DataFrame, table_cfg: dict, scale: str, label: str | None = None) -> str:
    """A booktabs tabular inside a table environment (needs booktabs and graphicx; amssymb for ✓)."""
    subs = _subheaders(scale)
    cols = _column_labels(table)
    k = len(subs)
    attr_cols, attr_rows = _row_attributes(table_cfg, table)
    a = len(attr_cols)
    labels, grid = _grid(table, scale, table_cfg)
    caption = latex_escape(f"{table_cfg.get('caption', '')} {scale_note(scale, _percent_only(table))}")
    lines = [r"\begin{table}[htbp]", r"\centering", rf"\caption{{{caption}}}"]
    if label:
        lines.append(rf"\label{{tab:{latex_escape(label)}}}")
    lines += [r"\resizebox{\linewidth}{!}{%", r"\begin{tabular}{l" + "c" * a + "r" * (k * len(cols)) + "}", r"\toprule"]
    lines.append(" & ".join([""] * (1 + a) + [rf"\multicolumn{{{k}}}{{c}}{{{latex_escape(c)}}}" for c in cols]) + r" \\")
    lines.append(" ".join(rf"\cmidrule(lr){{{2 + a + k * i}-{1 + a + k * (i + 1)}}}" for i in range(len(cols))))
    lines.append(" & ".join([latex_escape(table_cfg.get("row_header", "Method"))] + [latex_escape(c) for c in attr_cols] + [latex_escape(s) for s in subs] * len(cols))
                 + r" \\")
    lines.append(r"\midrule")
    for row_label, attrs, entries in zip(labels, attr_rows, grid):
        texts = [rf"\textbf{{{latex_escape(t)}}}" if b else latex_escape(t) for t, b in entries]
        lines.append(" & ".join([latex_escape(row_label)] + [latex_escape(x) for x in attrs] + texts) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}}", r"\par\smallskip", r"{\footnotesize"]
    lines.append(" \\\\\n".join(latex_escape(n) for n in footnotes(table, scale, table_cfg)))
    lines += ["}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def render_html(table: pd.DataFrame, table_cfg: dict, scale: str) -> str:
    """An HTML fragment for the report (fedcore/report/table_html.py): caption and scale note, each cell ours above
    the paper's (and Δ at paper scale), a row of test images per column, parts when wide, and the footnotes."""
    import html

    from fedcore.report.table_html import render_table_html

    caption = (f"<strong>{html.escape(table_cfg.get('caption', ''), quote=False)}</strong> "
               f"{html.escape(scale_note(scale, _percent_only(table)), quote=False)}")
    return render_table_html(table, table_cfg, scale, _grid(table, scale, table_cfg), _row_attributes(table_cfg, table),
                             caption, footnotes(table, scale, table_cfg))


def render_csv(table: pd.DataFrame) -> str:
    """The long-form cell table as CSV (documented in the module docstring)."""
    return table.to_csv(index=False, float_format="%.6g", lineterminator="\n")


def write_table(table: pd.DataFrame, table_cfg: dict, scale: str, out_md: str | os.PathLike,
                out_tex: str | os.PathLike, out_csv: str | os.PathLike, out_html: str | os.PathLike | None = None) -> None:
    """Write the table as Markdown, LaTeX, CSV (and an HTML page for the report); all are rendered before any
    is written."""
    texts = {
        Path(out_md): render_markdown(table, table_cfg, scale),
        Path(out_tex): render_latex(table, table_cfg, scale, label=Path(out_tex).stem),
        Path(out_csv): render_csv(table),
    }
    if out_html is not None:
        texts[Path(out_html)] = page(table_cfg.get("caption", Path(out_html).stem), render_html(table, table_cfg, scale))
    # Rename them only if every write succeeded, so the outputs never disagree with each other.
    with contextlib.ExitStack() as stack:
        tmps = {path: stack.enter_context(atomic_path(path)) for path in texts}
        for path, text in texts.items():
            tmps[path].write_text(text, encoding="utf-8")
