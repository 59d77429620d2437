"""Notes under a table that say how far its numbers can be trusted: which round the paper reports and which we
report, how many test images stand behind each column, columns that cannot tell the methods apart, and pairs of
rows that coincide (each computed from the built table; the config only says why a known pair may coincide)."""
from __future__ import annotations

import pandas as pd

from fedcore.report.resolution import ALL_EQUAL, ALL_ZERO, WILSON

DEGENERATE_MARK = "⚠"


def round_note(table_cfg: dict) -> str | None:
    """Which round's accuracy the paper reports (the paper's ``reported_round``: what, where it says so) and, where
    the paper picks the best round on the test set, that ours does the same."""
    rule = table_cfg.get("reported_round")
    if not rule:
        return None
    note = f"The paper reports {rule['paper']} ({rule['source']}); our report window follows it (below)."
    if rule.get("test_selected"):
        note += (" The paper picks that round on the test set, and so do we: the best of many evaluated rounds is "
                 "an optimistic number (no validation split).")
    return note


def column_sizes(table: pd.DataFrame) -> pd.DataFrame:
    """One row per column (in order): its label, n and what n counts (the most common among its cells with a
    known size, cells with a number first: a column's rows may read different experiments), and its flag."""
    out = []
    for j, cells in table.sort_values("col_index").groupby("col_index", sort=True):
        known = cells.loc[cells["test_images"].notna()] if "test_images" in cells else cells.iloc[0:0]
        if len(known) and (known["status"] == "ok").any():
            known = known.loc[known["status"] == "ok"]
        if len(known):
            n, what = known.groupby(["test_images", "test_images_of"]).size().idxmax()
        else:
            n, what = pd.NA, ""
        out.append({"col_index": j, "column": cells["column"].iloc[0], "n": n, "test_images_of": what,
                    "degenerate": cells["degenerate"].iloc[0] if "degenerate" in cells else ""})
    return pd.DataFrame(out, columns=["col_index", "column", "n", "test_images_of", "degenerate"])




def resolution_notes(table: pd.DataFrame) -> list[str]:
    """How many test images stand behind each column (grouped by count) and how single-seed cells' uncertainty is
    given; empty when no column is a proportion of known test images."""
    cols = column_sizes(table)
    known = cols.loc[cols["n"].notna()]
    if known.empty:
        return []
    groups = []
    for (n, what), grp in known.groupby(["n", "test_images_of"], sort=False):
        groups.append(f"{int(n)} ({what}; one image = {100.0 / int(n):.2f} points): {', '.join(grp['column'])}")
    notes = ["Test images behind each column: " + "; ".join(groups) + "."]
    if (table["interval"] == WILSON).any():
        notes.append("A single-seed accuracy's 95 % interval is the Wilson score interval for its proportion of "
                     "those images (CSV columns ci95_low, ci95_high; in the HTML table, hover a number). The rounds "
                     "of a report window re-use the same images, so they add none.")
    return notes


def degenerate_notes(table: pd.DataFrame) -> list[str]:
    """One note per column whose numbers are all 0 or all equal: it does not separate the methods."""
    notes = []
    for c in column_sizes(table).itertuples():
        if not c.degenerate:
            continue
        if c.degenerate == ALL_ZERO:
            what = "every number is 0"
        elif c.degenerate == ALL_EQUAL:
            what = "every number is the same"
        else:   # 'k of n equal (v)'
            count, value = c.degenerate.split(" equal (")
            what = f"{count} numbers are {value.rstrip(')')}"
        size = f" ({int(c.n)} test images: one image = {100.0 / int(c.n):.2f} points)" if pd.notna(c.n) else ""
        how = "does not separate" if c.degenerate in (ALL_ZERO, ALL_EQUAL) else "barely separates"
        notes.append(f"{DEGENERATE_MARK} {c.column}: {what}{size}; this column {how} the methods.")
    return notes


def identical_rows(table: pd.DataFrame, decimals: int = 2) -> list[tuple[str, str, int, float]]:
    """(row a, row b, cells, largest unrounded difference) for each pair of rows that show the same number in
    every column where both have one, at least two such columns."""
    ok = table.loc[(table["status"] == "ok") & table["ours"].notna()]
    by_row = {r: g.set_index("col_index")["ours"] for r, g in ok.groupby("row", sort=False)}
    rows = list(by_row)
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            common = by_row[a].index.intersection(by_row[b].index)
            if len(common) < 2:
                continue
            x, y = by_row[a].loc[common], by_row[b].loc[common]
            if (x.round(decimals) == y.round(decimals)).all():
                out.append((a, b, len(common), float((x - y).abs().max())))
    return out


def identical_notes(table: pd.DataFrame, table_cfg: dict) -> list[str]:
    """A note per pair of identical rows: the cells they share, and why (the paper's ``identical_rows`` entry for
    the pair), or that the config gives no reason."""
    labels = dict(zip(table["row"], table["row_label"]))
    whys = {frozenset(e["rows"]): e["why"] for e in table_cfg.get("identical_rows") or []}
    methods = {r: (table_cfg.get("row_sources") or {}).get(r, {}).get("method", r) for r in labels}
    notes = []
    for a, b, n, gap in identical_rows(table, int(table_cfg.get("decimals", 2))):
        why = whys.get(frozenset((a, b))) or whys.get(frozenset((methods[a], methods[b])))
        same = "identical numbers" if gap == 0 else f"the same numbers as shown (largest difference {gap:.2g})"
        text = f"{labels[a]} and {labels[b]}: {same} in all {n} cells where both have one. "
        notes.append(text + (f"Why: {why}" if why else "No reason is recorded for this pair: check that the two "
                                                         "runs are not copies of each other."))
    return notes
