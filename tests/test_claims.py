"""Claim check and scorecard: each predicate on tiny hand-made tables (holds, fails, runs missing), the claims'
config errors, a sweep figure read as a table, and the scorecard's counts."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fedcore.config import ConfigError, load_config
from fedcore.claim_rules import FAILS, HOLDS, MISSING, NO_PAPER_NUMBERS, check_claim, evaluate
from fedcore.report.claims import build_sweep_table
from fedcore.report.claims_report import claims_frame, render_claims_markdown
from fedcore.report.scorecard import build_scorecard, render_scorecard_markdown
from fedcore.report.tables import MISSING_RUN, NOT_IMPLEMENTED, OK

ROOT = Path(__file__).resolve().parents[1]


def grid(values: dict[str, list], columns: list[str], paper: dict[str, list] | None = None) -> pd.DataFrame:
    """A built-table frame: per row one value per column (None = a missing run)."""
    recs = []
    for row, vals in values.items():
        for j, (col, v) in enumerate(zip(columns, vals)):
            p = (paper or {}).get(row, [None] * len(columns))[j]
            recs.append({"row": row, "row_label": row.upper(), "column": col, "col_index": j, "method": row,
                         "ours": math.nan if v is None else float(v), "status": MISSING_RUN if v is None else OK,
                         "paper": math.nan if p is None else float(p)})
    return pd.DataFrame(recs)


T = grid({"a": [80.0, 70.0, 60.0], "b": [75.0, 72.0, 50.0], "c": [70.0, 71.0, None]}, ["x", "y", "z"],
         paper={"a": [90, 80, 70], "b": [85, 81, 60], "c": [80, 79, 55]})


@pytest.mark.parametrize("claim, verdict", [
    ({"predicate": "best_in_column", "row": "a", "columns": ["x"]}, HOLDS),
    ({"predicate": "best_in_column", "row": "a", "columns": ["x", "y"]}, FAILS),            # b beats a in y
    ({"predicate": "best_in_column", "row": "a", "columns": ["x", "z"]}, MISSING),          # c has no run in z
    ({"predicate": "best_in_column", "row": "a", "rows": ["a", "b"], "columns": ["z"]}, HOLDS),
    ({"predicate": "best_in_column", "row": "c", "direction": "min", "columns": ["x"]}, HOLDS),
    ({"predicate": "greater", "row": "a", "than": "b", "columns": ["x", "z"]}, HOLDS),
    ({"predicate": "greater", "row": "a", "than": "b", "columns": ["x", "z"], "margin": 5.0}, FAILS),  # 80-75 = 5
    ({"predicate": "greater", "row": "a", "than": ["b", "c"], "columns": ["x", "y"]}, FAILS),
    ({"predicate": "greater", "row": "a", "than": "b"}, FAILS),                              # not in y
    ({"predicate": "greater", "row": "a", "than": "b", "most": True}, HOLDS),                # 2 of 3
    ({"predicate": "greater", "column": "x", "than": "y", "rows": ["a", "b"]}, HOLDS),
    ({"predicate": "greater", "column": "x", "than": "z"}, MISSING),
    ({"predicate": "monotone", "along": "columns", "rows": ["a"], "direction": "decreasing"}, HOLDS),
    ({"predicate": "monotone", "along": "rows", "columns": ["x"], "direction": "decreasing"}, HOLDS),
    ({"predicate": "monotone", "along": "rows", "columns": ["y"], "direction": "decreasing"}, FAILS),
    ({"predicate": "monotone", "along": "rows", "columns": ["z"], "direction": "decreasing"}, MISSING),
    ({"predicate": "peaks", "along": "rows", "columns": ["y"]}, HOLDS),                      # 70, 72, 71
    ({"predicate": "peaks", "along": "rows", "columns": ["y"], "at": "a"}, FAILS),
    ({"predicate": "peaks", "along": "rows", "columns": ["x"]}, FAILS),                      # 80, 75, 70
    ({"predicate": "within", "row": "a", "than": "b", "tol": 2.0, "columns": ["y"]}, HOLDS),
    ({"predicate": "within", "row": "a", "than": "b", "tol": 2.0, "columns": ["x"]}, FAILS),
    ({"predicate": "within", "row": "c", "value": 70.5, "tol": 1.0, "columns": ["x", "y"]}, HOLDS),
])
def test_predicates_on_a_tiny_table(claim, verdict):
    v = evaluate(claim, T)
    assert v.verdict == verdict, v.detail
    assert v.numbers   # the numbers behind the verdict are reported


@pytest.mark.parametrize("claim, verdict", [
    # shown gap exactly 7.00: 64.01 - 57.01 is 7.000000000000007 in floats; within holds at |gap| <= tol
    ({"predicate": "within", "row": "a", "than": "b", "tol": 7.0}, HOLDS),
    # shown gap exactly the margin: greater needs more than the margin
    ({"predicate": "greater", "row": "b", "than": "a", "margin": 7.0}, FAILS),
    ({"predicate": "greater", "row": "d", "than": "c", "margin": 1.0}, FAILS),    # 2.14 - 1.14 = 1.0000000000000002
    ({"predicate": "within", "row": "c", "value": 2.14, "tol": 1.0}, HOLDS),
])
def test_tolerance_and_margin_compare_the_shown_gap(claim, verdict):
    """The verdicts compare numbers as shown: a gap shown as exactly the tolerance (or margin) is at it, not past
    it, whatever the float subtraction of the two rounded numbers gives."""
    t = grid({"a": [57.01], "b": [64.01], "c": [1.14], "d": [2.14]}, ["x"])
    v = evaluate(claim, t)
    assert v.verdict == verdict, v.detail


def test_verdict_reports_the_numbers_and_missing_cells_and_the_paper_check():
    v = evaluate({"predicate": "best_in_column", "row": "a", "columns": ["x", "z"]}, T)
    assert "missing run: C [z]" in v.detail and "A [x] = 80.00" in v.numbers_text()
    # the same predicate on the paper's numbers (b beats a in y there too); a table without them says so
    assert evaluate({"predicate": "best_in_column", "row": "a", "columns": ["x", "z"]}, T, use_paper=True).verdict == HOLDS
    assert evaluate({"predicate": "best_in_column", "row": "a"}, T, use_paper=True).verdict == FAILS
    no_paper = T.assign(paper=math.nan)
    assert evaluate({"predicate": "best_in_column", "row": "a"}, no_paper, use_paper=True).verdict == NO_PAPER_NUMBERS
    # the count names only the cells without a paper number (c's x here), not every cell read
    one_gap = T.assign(paper=[math.nan if (r, c) == ("c", "x") else p for r, c, p in zip(T["row"], T["column"], T["paper"])])
    v = evaluate({"predicate": "best_in_column", "row": "a", "columns": ["x"]}, one_gap, use_paper=True)
    assert v.verdict == NO_PAPER_NUMBERS and "no number for 1 of the 3 cells" in v.detail, v.detail
    # as shown: 70.004 and 70.001 are equal at 2 decimals, so not strictly increasing
    shown = grid({"p": [70.001], "q": [70.004]}, ["x"])
    assert evaluate({"predicate": "monotone", "along": "rows", "direction": "increasing"}, shown).verdict == FAILS
    assert evaluate({"predicate": "monotone", "along": "rows", "direction": "increasing", "strict": False},
                    shown).verdict == HOLDS


TABLES = {"t": {"caption": "", "rows": ["a", "b"], "paper": {},
                "columns": [{"label": "x", "experiment": "e", "metric": "global_acc"},
                            {"label": "y", "experiment": "e", "metric": "global_acc"}]},
          "p": {"kind": "param_count", "caption": "", "columns": []}}
SWEEP = {"kind": "sweep", "experiment": "e", "param_label": "k",
         "series": [{"label": "s1", "metric": "global_acc", "points": [{"value": 1, "method": "m1"},
                                                                      {"value": 2, "method": "m2"}]},
                    {"label": "s2", "metric": "global_acc", "points": [{"value": 2, "method": "n2"},
                                                                      {"value": 3, "method": "n3"}]}]}
FIGURES = {"f": SWEEP, "s": {"kind": "scatter"}}


@pytest.mark.parametrize("claim, message", [
    ({"table": "tt", "predicate": "greater", "row": "a", "than": "b"}, r"table 'tt' is not a table of this paper"),
    ({"table": "p", "predicate": "greater", "row": "a", "than": "b"}, r"not of kind metrics"),
    ({"figure": "s", "predicate": "peaks", "along": "rows"}, r"not a sweep figure of this paper; known: \['f'\]"),
    ({"table": "t", "predicate": "greater", "row": "a", "than": "c"}, r"than: 'c' is not a row; rows are \['a', 'b'\]"),
    ({"table": "t", "predicate": "best_in_column", "row": "a", "columns": ["z"]}, r"columns: 'z' is not a column"),
    ({"table": "t", "predicate": "best_in_column", "row": "a", "columns": [2]}, r"position 2 is out of range"),
    ({"table": "t", "predicate": "monotone", "along": "rows"}, r"monotone needs \['direction'\]"),
    ({"table": "t", "predicate": "within", "row": "a", "tol": 1, "margin": 1}, r"within does not take \['margin'\]"),
    ({"table": "t", "predicate": "greater", "than": "b"}, r"exactly one of 'row'"),
    ({"figure": "f", "predicate": "best_in_column", "row": "m1"}, r"row: 'm1' has no cell in column 's2'"),
    ({"figure": "f", "predicate": "greater", "row": "x9", "than": 2, "columns": ["s1"]}, r"or a method of the sweep"),
])
def test_claim_config_errors_name_the_key(claim, message):
    with pytest.raises(ValueError, match=message):
        check_claim({"id": "c", "sentence": "s", "source": "Table 1", **claim}, TABLES, FIGURES)


def test_sweep_rows_by_setting_or_method():
    check_claim({"id": "c", "sentence": "s", "source": "Fig", "figure": "f", "predicate": "best_in_column",
                 "row": "n3", "columns": ["s2"]}, TABLES, FIGURES)
    metrics = pd.DataFrame([{"paper": "x", "experiment": "e", "method": m, "scale": "mini", "dataset": "d", "seed": 0,
                             "round": 1, "client": -1, "split": "global", "metric": "acc", "value": v}
                            for m, v in [("m1", 0.5), ("m2", 0.6), ("n2", 0.7)]])
    exps = {"e": {"methods": ["m1", "m2", "n2", "n3"], "report": {"window": "last", "rounds": 1}, "rounds": 1}}
    frame = build_sweep_table(metrics, SWEEP, exps, "mini", {"m1", "m2", "n2", "n3"})
    assert list(frame["row"].drop_duplicates()) == ["1", "2", "3"]
    assert frame.loc[(frame["row"] == "1") & (frame["column"] == "s2"), "status"].item() == "no point"
    # n3 (setting 3 of s2) has no run; s1 rises over its own settings only; rows by method: m1 does not beat m2
    claim = {"predicate": "best_in_column", "row": "n3", "columns": ["s2"]}
    assert evaluate(claim, frame).verdict == MISSING
    assert evaluate({"predicate": "monotone", "along": "rows", "columns": ["s1"], "direction": "increasing"},
                    frame).verdict == HOLDS
    assert evaluate({"predicate": "greater", "row": "m1", "than": "m2", "columns": ["s1"]}, frame).verdict == FAILS
    assert evaluate({"predicate": "greater", "column": "s2", "than": "s1"}, frame).verdict == HOLDS  # at 2: 70 > 60


def _tiny_views(scale: str) -> dict:
    table = {"caption": "", "rows": ["a", "b", "z"], "paper": {"a": [60.0, 5.0], "b": [59.0, None]},
             "columns": [{"label": "acc", "experiment": "e", "metric": "global_acc"},
                         {"label": "up", "experiment": "e", "metric": "upload_numbers"}]}
    exps = {"e": {"methods": ["a", "b"], "report": {"window": "last", "rounds": 1}, "rounds": 1}}
    return {scale: {"tables": {"t": table}, "figures": {}, "experiments": exps, "implemented": ["a", "b"]}}


def _tiny_metrics(scale: str) -> pd.DataFrame:
    rows = [("a", "global", "acc", 0.61), ("a", "train", "upload_numbers_mean", 7.0), ("b", "global", "acc", 0.50)]
    return pd.DataFrame([{"paper": "x", "experiment": "e", "method": m, "scale": scale, "dataset": "d", "seed": 0,
                          "round": 1, "client": -1, "split": s, "metric": k, "value": v} for m, s, k, v in rows])


def test_scorecard_counts_and_largest_differences():
    card = build_scorecard(_tiny_views("paper"), _tiny_metrics("paper"))
    total = card.loc[(card["section"] == "cells") & (card["table"] == "all")].iloc[0]
    # 6 cells: a has both; b only acc (its upload has no run metric); z is not implemented
    assert (total["cells"], total["with_paper"], total["with_run"], total["missing_metric"],
            total["not_implemented"]) == (6, 3, 3, 1, 2)
    # compared: % cells with both numbers (a acc 61 vs 60, b acc 50 vs 59); the upload count is not in points
    assert (total["compared"], total["within_tol"]) == (2, 1)
    diffs = card.loc[card["section"] == "largest difference"]
    assert list(diffs["row"]) == ["b", "a"] and diffs["diff"].iloc[0] == pytest.approx(-9.0)
    assert "| t | b | acc | 50.00 | 59.00 | -9.00 |" in render_scorecard_markdown(card, "x")
    mini = build_scorecard(_tiny_views("mini"), _tiny_metrics("mini"))
    assert math.isnan(mini["compared"].iloc[0]) and (mini["section"] == "cells").all()


def test_claims_frame_per_scale_and_markdown():
    claims = [{"id": "a_best", "sentence": "A is best.", "source": "Table 1", "table": "t",
               "predicate": "best_in_column", "row": "a", "rows": ["a", "b"], "columns": ["acc"]}]
    views = {**_tiny_views("mini"), **_tiny_views("paper")}
    frame = claims_frame("x", claims, views, _tiny_metrics("mini"))
    assert list(frame["verdict"]) == [HOLDS, MISSING] and list(frame["on_paper_numbers"]) == [HOLDS, HOLDS]
    text = render_claims_markdown(frame, "x", {"mini"})
    assert "| a_best | Table 1 | holds | runs missing | holds |" in text
    assert "Scale paper: results/metrics.parquet holds no run of this scale" in text


def test_claim_errors_at_config_load_name_file_and_claim(tmp_path: Path):
    shutil.copytree(ROOT / "config", tmp_path / "config")
    path = tmp_path / "config" / "reports" / "sgpt.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["claims"][0]["columns"] = ["C100 Global s=5O"]
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    top = {**yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), "papers": ["sgpt"]}
    with pytest.raises(ConfigError, match=r"reports/sgpt.yaml \(claims\).*claims\[0\] \(t1_best_global_worst\): "
                                          r"columns: 'C100 Global s=5O' is not a column"):
        load_config(top, tmp_path)
