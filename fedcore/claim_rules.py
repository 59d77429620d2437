"""A paper's headline claim as data, from the configuration alone: its predicate over a grid of cells, checked
against the layout of the table or sweep figure it reads, and the cells (so the runs) its verdict needs. The report
(fedcore/report/claims.py) fills the grid with the built cells and judges it; the config checks every claim and,
for ``outputs: claims``, selects the runs it needs, without importing any report code.

comes from, a table and a generic predicate over its cells); the verdict per scale is holds / does not hold /
not selected / not configured / runs missing, with the numbers behind it.

A claim reads either a table of the paper (``table:``, the frame `build_table` makes, so it reads exactly the
cells a reader sees) or a sweep figure (``figure:``, kind sweep): its rows are the swept settings (value
order), its columns the series' labels, each cell the windowed metric of the series' run at that setting,
built like a table cell. In a sweep a row may be named by its setting (a number) or by the method the series
runs there (so a claim stays valid when a scale remaps the settings, SGPT Fig. 4).

Predicates (config key ``predicate``; columns are named by their labels or 0-based positions, rows by their
keys):

    best_in_column  row R is the highest (direction: max) or lowest (min) of `rows` (default: every row with a
                    cell in the column) in each of `columns`; a tie counts as holding and is said
    greater         row `row` > each row of `than` in every column of `columns` (or column `column` > each
                    column of `than` in every row of `rows`), by more than `margin` (default 0); `most: true`
                    = in more than half of the pairs instead of all
    monotone        `along: columns`: each of `rows` along the ordered `columns`; `along: rows`: each of
                    `columns` along the ordered `rows`; `direction` increasing | decreasing; `strict`
                    (default true) forbids equal neighbours
    peaks           as monotone's lines: rises to an interior maximum, then falls (pieces non-strict); `at`
                    names where the maximum must be (a row or column of the line)
    within          |row − than| <= `tol` (or |row − `value`|) in every column of `columns`

Every verdict compares the numbers as shown (rounded to the table's decimals). A needed cell without a number
makes the verdict "runs missing" when some such cell's run is configured and selected but has no metrics (a real
gap); otherwise "not configured" when some such cell is not configured at this scale (or not implemented), and
"not selected" when every such cell's run is configured but outside the outputs the config picks (`outputs`). The
numbers present are still listed. Each claim is also checked on the
paper's own numbers (where the table holds them) to show that the predicate encodes the sentence faithfully.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import pandas as pd

from fedcore.selection import NOT_CONFIGURED, NOT_IMPLEMENTED, NOT_SELECTED, OK, Run, row_source

HOLDS, FAILS, MISSING = "holds", "does not hold", "runs missing"
LISTED = 6  # at most this many "not selected" cells are named in a verdict's detail
NOT_RUN = "not selected"  # its runs are configured but not read by the chosen outputs (config `outputs`)
NOT_SET_UP = "not configured"  # some cell's method is not in its experiment at this scale (or has no code)
VERDICTS = (HOLDS, FAILS, NOT_RUN, NOT_SET_UP, MISSING)  # every verdict on our numbers, in the summary's order
COUNTED = {NOT_SELECTED, NOT_CONFIGURED, NOT_IMPLEMENTED}  # cells without a number that are counted, not listed
NO_PAPER_NUMBERS = "no paper numbers"
NO_POINT = "no point"   # a sweep's series without a run at this setting: not part of that column

# predicate -> (required keys, optional keys)
PREDICATES: dict[str, tuple[set[str], set[str]]] = {
    "best_in_column": ({"row"}, {"rows", "columns", "direction"}),
    "greater": ({"than"}, {"row", "column", "rows", "columns", "margin", "most"}),
    "monotone": ({"along", "direction"}, {"rows", "columns", "strict"}),
    "peaks": ({"along"}, {"rows", "columns", "at"}),
    "within": ({"row", "tol"}, {"than", "value", "columns"}),
}
CLAIM_KEYS = {"id", "sentence", "source", "table", "figure", "predicate", "note"}


# ----------------------------------------------------------------------------------------------
# The grid a claim reads: a table's layout, or a sweep figure as a table (report/claims.py fills it)
# ----------------------------------------------------------------------------------------------

def sweep_layout(fig_cfg: dict) -> tuple[list[float], list[str], dict[tuple[float, str], dict]]:
    """A sweep figure as a table: its settings (sorted), its series' labels, and (setting, label) -> point."""
    values = sorted({float(p["value"]) for s in fig_cfg["series"] for p in s["points"]})
    labels = [s["label"] for s in fig_cfg["series"]]
    points = {(float(p["value"]), s["label"]): {**p, "metric": s["metric"]}
              for s in fig_cfg["series"] for p in s["points"]}
    return values, labels, points


def value_key(value: float) -> str:
    """A sweep row's key: the setting as printed ('0.5', '3')."""
    return f"{value:g}"


def source_decimals(claim: dict, tables: dict[str, dict]) -> int:
    """Decimals the numbers are shown with (the table's, 2 for a sweep)."""
    return int(tables[claim["table"]].get("decimals", 2)) if "table" in claim else 2


# ----------------------------------------------------------------------------------------------
# Checking a claim's config against its table or figure (at load time, before any work)
# ----------------------------------------------------------------------------------------------

def layout(claim: dict, tables: dict[str, dict], figures: dict[str, dict]) -> tuple[list[str], list[str], dict]:
    """(row keys, column labels, column -> {method: row key}) of the claim's source, from the config alone."""
    if "table" in claim:
        t = tables[claim["table"]]
        return list(t["rows"]), [c["label"] for c in t["columns"]], {}
    values, labels, points = sweep_layout(figures[claim["figure"]])
    methods = {label: {p["method"]: value_key(v) for (v, lab), p in points.items() if lab == label} for label in labels}
    return [value_key(v) for v in values], labels, methods


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def resolve_row(name: Any, column: str, rows: list[str], methods: dict) -> str | None:
    """A row named by its key, by a sweep setting (a number) or by the method a sweep column runs there."""
    if isinstance(name, (int, float)) and not isinstance(name, bool):
        name = value_key(float(name))
    name = str(name)
    if name in rows:
        return name
    return (methods.get(column) or {}).get(name)


def _column(name: Any, cols: list[str], key: str) -> str:
    """A column named by its label, or by its 0-based position (a sweep's series whose label a scale changes)."""
    if isinstance(name, int) and not isinstance(name, bool):
        if not 0 <= name < len(cols):
            raise ValueError(f"{key}: column position {name} is out of range; columns are {cols}")
        return cols[name]
    if name not in cols:
        raise ValueError(f"{key}: {name!r} is not a column; columns are {cols}")
    return name


def with_column_labels(claim: dict, cols: list[str]) -> dict:
    """The claim with every column reference (label or position) replaced by the column's label."""
    out = dict(claim)
    if "columns" in out:
        out["columns"] = [_column(c, cols, "columns") for c in _as_list(out["columns"])]
    if "column" in out:
        out["column"] = _column(out["column"], cols, "column")
        if out["predicate"] == "greater":   # columns compared: `than` names columns
            out["than"] = [_column(c, cols, "than") for c in _as_list(out["than"])]
    if out["predicate"] in ("monotone", "peaks") and out.get("along") == "columns" and "at" in out:
        out["at"] = _column(out["at"], cols, "at")
    return out


def check_claim(claim: dict, tables: dict[str, dict], figures: dict[str, dict]) -> None:
    """Raise ValueError naming the key when a claim's predicate, rows or columns do not fit its source."""
    unknown = sorted(set(claim) - CLAIM_KEYS - set().union(*(r | o for r, o in PREDICATES.values())))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}")
    if ("table" in claim) == ("figure" in claim):
        raise ValueError("needs exactly one of 'table' or 'figure'")
    if "table" in claim:
        if claim["table"] not in tables:
            raise ValueError(f"table {claim['table']!r} is not a table of this paper; known: {sorted(tables)}")
        if tables[claim["table"]].get("kind", "metrics") != "metrics":
            raise ValueError(f"table {claim['table']!r} is not of kind metrics (claims read run metrics)")
    else:
        fig = figures.get(claim["figure"])
        if fig is None or fig["kind"] != "sweep":
            sweeps = sorted(n for n, f in figures.items() if f["kind"] == "sweep")
            raise ValueError(f"figure {claim['figure']!r} is not a sweep figure of this paper; known: {sweeps}")
    pred = claim["predicate"]
    if pred not in PREDICATES:
        raise ValueError(f"predicate {pred!r}; expected one of {sorted(PREDICATES)}")
    required, optional = PREDICATES[pred]
    args = set(claim) - CLAIM_KEYS
    if required - args:
        raise ValueError(f"predicate {pred} needs {sorted(required - args)}")
    if args - required - optional:
        raise ValueError(f"predicate {pred} does not take {sorted(args - required - optional)}; "
                         f"it takes {sorted(required | optional)}")
    if pred == "greater" and ("row" in claim) == ("column" in claim):
        raise ValueError("greater needs exactly one of 'row' (rows compared) or 'column' (columns compared)")
    if pred == "within" and ("than" in claim) == ("value" in claim):
        raise ValueError("within needs exactly one of 'than' (a row) or 'value' (a number)")
    if pred in ("monotone", "peaks") and claim["along"] not in ("rows", "columns"):
        raise ValueError(f"along: {claim['along']!r}; expected rows or columns")
    if pred == "monotone" and claim["direction"] not in ("increasing", "decreasing"):
        raise ValueError(f"direction: {claim['direction']!r}; expected increasing or decreasing")
    if pred == "best_in_column" and claim.get("direction", "max") not in ("max", "min"):
        raise ValueError(f"direction: {claim['direction']!r}; expected max or min")
    rows, cols, methods = layout(claim, tables, figures)
    claim = with_column_labels(claim, cols)
    names = _row_names(claim)
    if pred == "greater" and "column" in claim:
        names = [(k, n) for k, n in names if k != "than"]
    if pred in ("monotone", "peaks") and claim["along"] == "columns" and "at" in claim:
        names = [(k, n) for k, n in names if k != "at"]
    use_cols = _as_list(claim.get("columns", cols)) + _as_list(claim.get("column", []))
    for key, name in names:
        if not any(resolve_row(name, c, rows, methods) for c in use_cols):
            extra = f" or a method of the sweep ({sorted(set().union(*methods.values()))})" if methods else ""
            raise ValueError(f"{key}: {name!r} is not a row; rows are {rows}{extra}")
    if pred in ("best_in_column", "within") or (pred == "greater" and "row" in claim):
        for c in use_cols:   # the row under test must have a cell in every column it is tested in
            if resolve_row(claim["row"], c, rows, methods) is None:
                raise ValueError(f"row: {claim['row']!r} has no cell in column {c!r}")


def _row_names(claim: dict) -> list[tuple[str, Any]]:
    """(key, name) of every row a claim names."""
    out = [(k, claim[k]) for k in ("row", "at") if k in claim]
    out += [("than", n) for n in _as_list(claim.get("than", []))]
    out += [("rows", n) for n in claim.get("rows", [])]
    return out


# ----------------------------------------------------------------------------------------------
# Evaluating
# ----------------------------------------------------------------------------------------------

@dataclass
class Verdict:
    """A predicate's outcome and the numbers it used (label, column, shown value or why there is none)."""

    verdict: str
    detail: str
    numbers: list[tuple[str, str, float | str]] = field(default_factory=list)

    def numbers_text(self, decimals: int = 2) -> str:
        """'label [column] = 12.34; …' in the order used ('' when no cell has a number)."""
        if not any(isinstance(v, float) for _, _, v in self.numbers):
            return ""
        # cells left out by the chosen outputs or not run at this scale are counted in the detail, not listed here
        return "; ".join(f"{lab} [{col}] = {v:.{decimals}f}" if isinstance(v, float) else f"{lab} [{col}] = {v}"
                         for lab, col, v in self.numbers if v not in COUNTED)


class Grid:
    """Cell lookup on a claim's long-form frame: values as shown (rounded), and the numbers used."""

    def __init__(self, frame: pd.DataFrame, decimals: int, use_paper: bool = False):
        self.decimals = decimals
        self.rows = list(dict.fromkeys(frame["row"]))
        self.columns = list(frame.drop_duplicates("col_index").sort_values("col_index")["column"])
        self.methods: dict[str, dict[str, str]] = {}
        self.cells: dict[tuple[str, str], tuple[str, float | str]] = {}
        for r in frame.itertuples():
            if use_paper:
                value: float | str = NO_PAPER_NUMBERS if pd.isna(r.paper) else round(float(r.paper), decimals)
            elif r.status == OK and not pd.isna(r.ours):
                value = round(float(r.ours), decimals)
            else:
                value = r.status
            self.cells[(r.row, r.column)] = (r.row_label, value)
            if r.method:
                self.methods.setdefault(r.column, {})[r.method] = r.row
        self.used: list[tuple[str, str, float | str]] = []
        self.used_keys: list[tuple[str, str]] = []   # (row key, column) of every cell read, in reading order

    def key(self, name: Any, column: str) -> str | None:
        """The row key a claim's row name means in `column` (None: the sweep has no such point there)."""
        return resolve_row(name, column, self.rows, self.methods)

    def has(self, row: str | None, column: str) -> bool:
        """Whether the cell is part of the source (a sweep series has no point at every setting)."""
        return row is not None and self.cells.get((row, column), ("", NO_POINT))[1] != NO_POINT

    def get(self, row: str, column: str) -> float | None:
        """The shown value, or None (recorded with its reason) when the cell has no number."""
        label, value = self.cells[(row, column)]
        self.used.append((label, column, value))
        self.used_keys.append((row, column))
        return value if isinstance(value, float) else None

    def verdict(self, ok: bool | None, detail: str) -> Verdict:
        """holds / does not hold, or (some cell used had no number) runs missing / not configured / not selected."""
        missing: dict[str, list[str]] = {}
        for lab, col, v in dict.fromkeys(self.used):
            if not isinstance(v, float):
                missing.setdefault(str(v), []).append(f"{lab} [{col}]")
        if missing:
            n, total = sum(map(len, missing.values())), len(set(self.used))
            verdict = missing_verdict(set(missing))
            if n == total:   # nothing to list cell by cell
                return Verdict(verdict, f"none of the {total} cells has a number ({', '.join(missing)})", self.used)
            # a long list of cells outside the chosen outputs says nothing a count does not
            why = "; ".join(f"{status}: {len(cells)} cells" if status in COUNTED and len(cells) > LISTED
                            else f"{status}: {', '.join(cells)}" for status, cells in missing.items())
            return Verdict(verdict, f"{n} of {total} cells have no number ({why})"
                           + (f"; on the others: {detail}" if detail else ""), self.used)
        return Verdict(HOLDS if ok else FAILS, detail, self.used)


def missing_verdict(statuses: set[str]) -> str:
    """The verdict of a claim some of whose cells have no number, from those cells' statuses: a configured and
    selected run without metrics is a gap (runs missing); else cells the scale does not configure (not
    configured) outrank cells the chosen outputs leave out (not selected), which one command would fill."""
    if statuses - {NOT_SELECTED, NOT_CONFIGURED, NOT_IMPLEMENTED}:
        return MISSING
    return NOT_SET_UP if statuses & {NOT_CONFIGURED, NOT_IMPLEMENTED} else NOT_RUN


def _fmt(x: float, d: int) -> str:
    return f"{x:.{d}f}"


def best_in_column(g: Grid, c: dict) -> Verdict:
    """Row R is the highest (max) or lowest (min) of the rows in each column."""
    lowest = c.get("direction", "max") == "min"
    ok, notes = True, []
    for col in c.get("columns", g.columns):
        target = g.key(c["row"], col)
        names = c.get("rows") or g.rows
        rows = [k for k in (g.key(n, col) for n in names) if g.has(k, col)]
        mine = g.get(target, col)
        others = {k: g.get(k, col) for k in rows if k != target}
        vals = {k: v for k, v in others.items() if v is not None}
        if mine is None or not vals:
            continue
        best_k = (min if lowest else max)(vals, key=vals.get)
        beaten = vals[best_k] < mine if lowest else vals[best_k] > mine
        if beaten:
            ok = False
            notes.append(f"{col}: {g.cells[(best_k, col)][0]} {_fmt(vals[best_k], g.decimals)} beats "
                         f"{_fmt(mine, g.decimals)}")
        elif vals[best_k] == mine:
            notes.append(f"{col}: tied with {g.cells[(best_k, col)][0]}")
    return g.verdict(ok, "; ".join(notes))


def _pairs(g: Grid, c: dict) -> list[tuple[str, str, str, str]]:
    """(row A, column A, row B, column B) pairs a greater/within claim compares."""
    pairs = []
    if "column" in c:   # a column against others, row by row
        for name in c.get("rows") or g.rows:
            for other in _as_list(c["than"]):
                ka, kb = g.key(name, c["column"]), g.key(name, other)
                if g.has(ka, c["column"]) and g.has(kb, other):
                    pairs.append((ka, c["column"], kb, other))
        return pairs
    for col in c.get("columns", g.columns):
        a = g.key(c["row"], col)
        for other in _as_list(c.get("than", [])):
            b = g.key(other, col)
            if g.has(a, col) and g.has(b, col):
                pairs.append((a, col, b, col))
    return pairs


def greater(g: Grid, c: dict) -> Verdict:
    """A > B (+ margin) in every compared pair (or, with `most`, in more than half of them)."""
    margin = float(c.get("margin", 0.0))
    results, notes = [], []
    for a, ca, b, cb in _pairs(g, c):
        va, vb = g.get(a, ca), g.get(b, cb)
        if va is None or vb is None:
            continue
        # the gap as shown: two rounded numbers' float difference can land just past the margin (64.01 - 57.01)
        holds = round(va - vb, g.decimals) > margin
        results.append(holds)
        if not holds:
            where = ca if ca == cb else f"{g.cells[(a, ca)][0]}: {ca} vs {cb}"
            notes.append(f"{where}: {_fmt(va, g.decimals)} vs {_fmt(vb, g.decimals)}")
    ok = sum(results) * 2 > len(results) if c.get("most") else all(results)
    summary = f"{sum(results)} of {len(results)} pairs hold" + (" (needs more than half)" if c.get("most") else "")
    return g.verdict(ok and bool(results), "; ".join([summary] + notes))


def within(g: Grid, c: dict) -> Verdict:
    """|A − B| (or |A − value|) <= tol in every column."""
    tol, notes, ok = float(c["tol"]), [], True
    for col in c.get("columns", g.columns):
        a = g.key(c["row"], col)
        if not g.has(a, col):
            continue
        va = g.get(a, col)
        if "value" in c:
            vb: float | None = float(c["value"])
        else:
            b = g.key(c["than"], col)
            vb = g.get(b, col) if g.has(b, col) else None
        if va is None or vb is None:
            continue
        if round(abs(va - vb), g.decimals) > tol:   # the gap as shown (see greater)
            ok = False
            notes.append(f"{col}: |{_fmt(va, g.decimals)} − {_fmt(vb, g.decimals)}| > {tol:g}")
    return g.verdict(ok, "; ".join(notes))


def _lines(g: Grid, c: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """monotone/peaks: (name, ordered cells) per line; a row along columns, or a column along rows."""
    if c["along"] == "columns":
        cols = c.get("columns", g.columns)
        out = []
        for name in c.get("rows") or g.rows:
            cells = [(k, col) for col in cols for k in [g.key(name, col)] if g.has(k, col)]
            out.append((str(name), cells))
        return out
    out = []
    for col in c.get("columns", g.columns):
        keys = [g.key(n, col) for n in (c.get("rows") or g.rows)]
        out.append((col, [(k, col) for k in keys if g.has(k, col)]))
    return out


def monotone(g: Grid, c: dict) -> Verdict:
    """Every line increases (decreases) from one cell to the next; strictly unless strict: false."""
    up, strict = c["direction"] == "increasing", c.get("strict", True)
    ok, notes = True, []
    for name, cells in _lines(g, c):
        vals = [g.get(k, col) for k, col in cells]
        if any(v is None for v in vals) or len(vals) < 2:
            continue
        for (k0, c0), (k1, c1), v0, v1 in zip(cells, cells[1:], vals, vals[1:]):
            step = v1 - v0 if up else v0 - v1
            if step < 0 or (strict and step == 0):
                ok = False
                notes.append(f"{name}: {_fmt(v0, g.decimals)} → {_fmt(v1, g.decimals)} "
                             f"({g.cells[(k0, c0)][0]} [{c0}] → {g.cells[(k1, c1)][0]} [{c1}])")
    return g.verdict(ok, "; ".join(notes))


def peaks(g: Grid, c: dict) -> Verdict:
    """Every line rises to an interior maximum, then falls; at `at` when given."""
    ok, notes = True, []
    for name, cells in _lines(g, c):
        if len(cells) < 3:
            ok = False
            notes.append(f"{name}: fewer than 3 points")
            continue
        vals = [g.get(k, col) for k, col in cells]
        if any(v is None for v in vals):
            continue
        top = max(range(len(vals)), key=vals.__getitem__)
        shape = (0 < top < len(vals) - 1 and vals[top] > vals[0] and vals[top] > vals[-1]
                 and all(a <= b for a, b in zip(vals[:top], vals[1:top + 1]))
                 and all(a >= b for a, b in zip(vals[top:], vals[top + 1:])))
        k, col = cells[top]
        where = col if c["along"] == "columns" else g.cells[(k, col)][0]
        if not shape:
            ok = False
            notes.append(f"{name}: not rise-then-fall ({', '.join(_fmt(v, g.decimals) for v in vals)})")
        if "at" in c:
            at = c["at"] if c["along"] == "columns" else g.key(c["at"], col)
            if (col if c["along"] == "columns" else k) != at:
                ok = False
                notes.append(f"{name}: maximum at {where}")
    return g.verdict(ok, "; ".join(notes))


EVALUATORS = {"best_in_column": best_in_column, "greater": greater, "monotone": monotone, "peaks": peaks,
              "within": within}


def evaluate(claim: dict, frame: pd.DataFrame, decimals: int = 2, use_paper: bool = False) -> Verdict:
    """A claim's verdict on a built frame: our numbers, or (use_paper) the paper's numbers in the same cells."""
    grid = Grid(frame, decimals, use_paper)
    v = EVALUATORS[claim["predicate"]](grid, with_column_labels(claim, grid.columns))
    if not v.numbers:
        return Verdict(MISSING if not use_paper else NO_PAPER_NUMBERS, "no cell to compare", [])
    if use_paper and v.verdict == MISSING:
        n = sum(not isinstance(value, float) for _, _, value in dict.fromkeys(v.numbers))
        return Verdict(NO_PAPER_NUMBERS, f"the paper prints no number for {n} of the {len(set(v.numbers))} cells",
                       v.numbers)
    return v


def layout_frame(claim: dict, tables: dict[str, dict], figures: dict[str, dict]) -> pd.DataFrame:
    """The claim's source as a frame of cells that all have a number (0.0), from the config alone; a sweep's
    settings without a point of a series stay without one (`no point`)."""
    rows, cols, methods = layout(claim, tables, figures)
    points = sweep_layout(figures[claim["figure"]])[2] if "figure" in claim else {}
    records = []
    for row in rows:
        for j, col in enumerate(cols):
            point = points.get((float(row), col)) if "figure" in claim else {"method": row}
            records.append({"row": row, "row_label": row, "column": col, "col_index": j, "ours": 0.0,
                            "status": OK if point else NO_POINT, "paper": math.nan,
                            "method": point["method"] if point else ""})
    return pd.DataFrame.from_records(records)


def claim_cells(claim: dict, tables: dict[str, dict], figures: dict[str, dict]) -> list[tuple[str, str]]:
    """(row key, column label) of every cell the claim's predicate reads when every cell has a number: the cells
    its verdict needs (runs the claim's `outputs: claims` selection trains)."""
    grid = Grid(layout_frame(claim, tables, figures), 2)
    EVALUATORS[claim["predicate"]](grid, with_column_labels(claim, grid.columns))
    return list(dict.fromkeys(grid.used_keys))


def describe(claim: dict) -> str:
    """The predicate in words, e.g. 'best_in_column(row=sgpt, columns=[...])'."""
    args = {k: v for k, v in claim.items() if k not in CLAIM_KEYS}
    return f"{claim['predicate']}(" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")"


def claim_runs(claim: dict, tables: Mapping[str, dict], figures: Mapping[str, dict],
               experiments: Mapping[str, dict]) -> set[Run]:
    """The configured runs whose cells one claim's verdict needs (``outputs: claims``; the config's selection)."""
    wanted: set[Run] = set()
    if "table" in claim:
        table = tables[claim["table"]]
        by_label = {c["label"]: c for c in table["columns"]}
        for row, label in claim_cells(claim, tables, figures):
            method, col = row_source(table, row, by_label[label])
            wanted.add((col["experiment"], method))
    else:
        fig = figures[claim["figure"]]
        points = sweep_layout(fig)[2]
        for row, label in claim_cells(claim, tables, figures):
            p = points[(float(row), label)]
            wanted.add((p.get("experiment", fig["experiment"]), p["method"]))
    return {(e, m) for e, m in wanted if e in experiments and m in experiments[e]["methods"]}
