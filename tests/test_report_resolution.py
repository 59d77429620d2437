"""The resolution of the tables' numbers: test images per cell, Wilson intervals, degenerate columns."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from fedcore.partition.file import Partition
from fedcore.report.resolution import (ALL_EQUAL, ALL_ZERO, NOT_A_PROPORTION, RESOLUTION_COLUMNS, SEED_STD, WILSON,
                                       EvalSizes, cell_test_images, eval_sizes, wilson_interval)
from fedcore.report.tables import TABLE_COLUMNS, build_table, render_csv


def test_wilson_interval_matches_the_textbook_values():
    lo, hi = wilson_interval(0.5, 100)
    assert (lo, hi) == pytest.approx((0.40383, 0.59617), abs=1e-5)
    lo, hi = wilson_interval(0.0, 31)                 # SGPT's Five-dataset worst local: 0 of 31 images
    assert lo == 0.0 and hi == pytest.approx(3.8415 / (31 + 3.8415), abs=1e-5)   # z² / (n + z²)
    assert wilson_interval(1.0, 10)[1] == pytest.approx(1.0) and math.isnan(wilson_interval(0.3, 0)[0])


def test_test_sizes_from_a_partition(tmp_path):
    # two clients sharing image 2: the pooled global set counts it once
    part = Partition([np.array([0]), np.array([1])], [np.array([0, 1, 2]), np.array([2, 3])], {"scheme": "x"}, 0)
    part.save(tmp_path / "p.npz")
    assert eval_sizes(tmp_path / "p.npz", "pooled_local", None) == EvalSizes((3, 2), 4)
    assert eval_sizes(tmp_path / "p.npz", "official_test", 315) == EvalSizes((3, 2), 315, 315)
    assert eval_sizes(tmp_path / "p.npz", "pooled_local", 315) == EvalSizes((3, 2), 4, 315)


def test_select_cluster_acc_counts_the_whole_test_split():
    # SGPT Table 4 scores every test image, not the union of the local test sets
    assert cell_test_images("select_cluster_acc", -1, None, EvalSizes((20, 15, 10), 40, 100))[0] == 100
    assert cell_test_images("select_cluster_acc", -1, None, EvalSizes((20, 15, 10), 40))[0] is None


@pytest.mark.parametrize("metric, client, clients, n", [
    ("global_acc", -1, None, 40), ("global_acc_min", -1, None, 40), ("local_acc", -1, None, 45),
    ("worst_local_acc", -1, None, 10), ("client_acc", 1, None, 15), ("client_acc", -1, [0, 2], 30),
    ("upload_numbers", -1, None, None),
])
def test_each_metric_counts_its_own_test_set(metric, client, clients, n):
    got, what = cell_test_images(metric, client, clients, EvalSizes((20, 15, 10), 40))
    assert got == n and what
    assert cell_test_images("global_acc", -1, None, None)[0] is None


def _metrics(values: dict[tuple[str, int], list[float]]) -> pd.DataFrame:
    """Final-round global accuracies of methods a, b, c (one value per seed)."""
    return pd.DataFrame([{"paper": "p", "experiment": "e", "method": m, "scale": "mini", "dataset": "d", "seed": s,
                          "round": 1, "client": -1, "split": "global", "metric": "acc", "value": v}
                         for (m, _), vals in values.items() for s, v in enumerate(vals)])


TABLE = {"caption": "T", "rows": ["a", "b", "c"],
         "columns": [{"label": "acc", "experiment": "e", "metric": "global_acc"},
                     {"label": "up", "experiment": "e", "metric": "upload_numbers"}]}
EXPS = {"e": {"methods": ["a", "b", "c"], "report": {"window": "last", "rounds": 1}, "rounds": 1}}


def test_table_cells_carry_their_resolution_and_the_csv_has_its_columns():
    metrics = _metrics({("a", 0): [0.5], ("b", 0): [0.25, 0.35], ("c", 0): [0.0]})
    table = build_table(metrics, TABLE, EXPS, "mini", {"a", "b", "c"}, {"e": EvalSizes((50, 50), 100)})
    acc = table.loc[table["column"] == "acc"].set_index("row")
    assert list(acc["test_images"]) == [100, 100, 100] and acc.loc["a", "step"] == pytest.approx(1.0)
    assert acc.loc["a", "interval"] == WILSON
    assert (acc.loc["a", "ci95_low"], acc.loc["a", "ci95_high"]) == pytest.approx((40.383, 59.617), abs=1e-3)
    assert acc.loc["b", "interval"] == SEED_STD and math.isnan(acc.loc["b", "ci95_low"])
    up = table.loc[table["column"] == "up"]
    assert set(up["test_images_of"]) == {NOT_A_PROPORTION} and up["test_images"].isna().all()
    csv = pd.read_csv(__import__("io").StringIO(render_csv(table)))
    assert list(csv.columns) == TABLE_COLUMNS and set(RESOLUTION_COLUMNS) <= set(csv.columns)


def test_degenerate_columns_are_flagged():
    zero = build_table(_metrics({("a", 0): [0.0], ("b", 0): [0.0], ("c", 0): [0.0]}), TABLE, EXPS, "mini",
                       {"a", "b", "c"})
    assert set(zero.loc[zero["column"] == "acc", "degenerate"]) == {ALL_ZERO}
    equal = build_table(_metrics({("a", 0): [0.3], ("b", 0): [0.3], ("c", 0): [0.3]}), TABLE, EXPS, "mini",
                        {"a", "b", "c"})
    assert set(equal.loc[equal["column"] == "acc", "degenerate"]) == {ALL_EQUAL}
    mixed = build_table(_metrics({("a", 0): [0.3], ("b", 0): [0.0], ("c", 0): [0.3]}), TABLE, EXPS, "mini",
                        {"a", "b", "c"})
    assert set(mixed["degenerate"]) == {""}
    four = {**TABLE, "rows": ["a", "b", "c", "d"]}
    mostly = build_table(_metrics({("a", 0): [0.0], ("b", 0): [0.0], ("c", 0): [0.0], ("d", 0): [0.0215]}), four,
                         {"e": {**EXPS["e"], "methods": ["a", "b", "c", "d"]}}, "mini", {"a", "b", "c", "d"})
    assert set(mostly.loc[mostly["column"] == "acc", "degenerate"]) == {"3 of 4 equal (0.00)"}
    from fedcore.report.table_notes import degenerate_notes

    assert degenerate_notes(mostly) == ["⚠ acc: 3 of 4 numbers are 0.00; this column barely separates the methods."]


def test_rows_identical_in_every_cell_get_a_note_with_the_configured_reason():
    from fedcore.report.table_notes import identical_notes, identical_rows

    two = {**TABLE, "columns": [TABLE["columns"][0], {**TABLE["columns"][0], "label": "acc2"}]}
    table = build_table(_metrics({("a", 0): [0.30001], ("b", 0): [0.3], ("c", 0): [0.5]}), two, EXPS, "mini",
                        {"a", "b", "c"})
    [(a, b, n, gap)] = identical_rows(table)
    assert (a, b, n) == ("a", "b", 2) and gap == pytest.approx(1e-3)       # equal as shown (2 decimals)
    notes = identical_notes(table, {**two, "identical_rows": [{"rows": ["b", "a"], "why": "B is A here."}]})
    assert notes == ["a and b: the same numbers as shown (largest difference 0.001) in all 2 cells where both "
                     "have one. Why: B is A here."]
    assert "No reason is recorded" in identical_notes(table, two)[0]
    assert identical_rows(table.assign(ours=[30.0, 30.0, 31.0, 31.5, 50.0, 50.0])) == []


def test_the_reported_round_and_a_test_set_selection_are_said():
    from fedcore.report.table_notes import round_note

    assert round_note({}) is None
    note = round_note({"reported_round": {"paper": "the best round", "source": "§4.1", "test_selected": True}})
    assert note.startswith("The paper reports the best round (§4.1)") and "on the test set" in note



def test_every_kind_of_degenerate_column_gets_its_note():
    from fedcore.report.table_notes import degenerate_notes

    zero = build_table(_metrics({("a", 0): [0.0], ("b", 0): [0.0], ("c", 0): [0.0]}), TABLE, EXPS, "mini",
                       {"a", "b", "c"}, {"e": EvalSizes((31, 31), 62)})
    assert degenerate_notes(zero) == ["⚠ acc: every number is 0 (62 test images: one image = 1.61 points); this "
                                      "column does not separate the methods."]
    same = build_table(_metrics({("a", 0): [0.5], ("b", 0): [0.5], ("c", 0): [0.5]}), TABLE, EXPS, "mini",
                       {"a", "b", "c"})
    assert degenerate_notes(same) == ["⚠ acc: every number is the same; this column does not separate the methods."]
