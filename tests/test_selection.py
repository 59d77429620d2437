"""`outputs`: which tables and figures are built and hence which runs are trained; unselected cells say so."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fedcore.config import ConfigError, load_config
from fedcore.papers import PAPERS
from fedcore.claim_rules import NOT_RUN, Grid, greater
from fedcore.report.inventory import NOT_SELECTED as RUN_NOT_SELECTED, build_inventory, configured_runs
from fedcore.report.tables import MISSING_RUN, NOT_SELECTED, OK, build_table
from fedcore.selection import chosen_outputs, figure_runs, output_runs, table_runs

ROOT = Path(__file__).resolve().parents[1]
ALL_PAPERS = list(PAPERS)


def _cfg(root: Path = ROOT, papers=("sgpt",), **top):
    """The config of ``papers`` (SGPT alone loads fastest) with ``top``'s keys."""
    return load_config({"scale": "mini", "seeds": [0], "papers": list(papers), **top}, root)


@pytest.fixture(scope="module")
def every():
    return _cfg(outputs="all")


TABLE = {"rows": ["a", "b", "c"], "row_sources": {"c": {"method": "a_v2", "experiment_replace": ["x", "y"]}},
         "columns": [{"label": "X1", "experiment": "x1", "metric": "global_acc"},
                     {"label": "X2", "experiment": "x2", "metric": "global_acc"}]}


def test_a_table_reads_each_row_in_each_column_through_its_row_source():
    assert table_runs(TABLE) == {("x1", "a"), ("x2", "a"), ("x1", "b"), ("x2", "b"), ("y1", "a_v2"), ("y2", "a_v2")}
    assert table_runs(TABLE, {"columns": ["X2"]}) == {("x2", "a"), ("x2", "b"), ("y2", "a_v2")}
    assert table_runs(TABLE, {"columns": [0], "rows": ["b"]}) == {("x1", "b")}
    assert table_runs({"kind": "param_count", "columns": []}) == set()


def test_a_sweep_reads_its_points_and_a_per_class_figure_its_lines():
    sweep = {"kind": "sweep", "experiment": "e", "series": [
        {"points": [{"value": 1, "method": "m1"}, {"value": 2, "method": "m2", "experiment": "f"}]}]}
    assert figure_runs(sweep, {}) == {("e", "m1"), ("f", "m2")}
    per_class = {"kind": "per_class", "panels": [{"experiment": "p_a", "label": "A"}], "methods": ["m"],
                 "lines": [{"label": "L", "method": "n", "experiment_replace": ["_a", "_b"]}]}
    assert figure_runs(per_class, {}) == {("p_a", "m"), ("p_b", "n")}
    per_round = {"kind": "accuracy_per_round", "experiments": ["e"]}
    assert figure_runs(per_round, {"e": {"methods": ["m1", "m2"]}}) == {("e", "m1"), ("e", "m2")}


def test_all_selects_every_configured_run(every):
    assert every.selected is None
    assert len(every.runs()) == len(every.runs(selected_only=False))
    assert set(every.outputs) == set(every.tables) | set(every.figures)


def test_a_list_of_outputs_runs_only_what_they_read(every):
    cfg = _cfg(outputs=["sgpt_fig1"])
    assert cfg.outputs == ["sgpt_fig1"]
    runs = {(r["experiment"], r["method"]) for r in cfg.runs()}
    assert runs == {("sgpt_c100_s10", m) for m in every.figures["sgpt_fig1"]["methods"]}
    assert len(cfg.runs(selected_only=False)) == len(every.runs())
    # partitions (and their heat maps) only of experiments with a selected run
    assert {pid for _, pid in cfg.partitions(run_only=True)} == {cfg.experiments["sgpt_c100_s10"]["partition_id"]}


def test_an_unknown_output_is_an_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"outputs: outputs names \['sgpt_table99'\].*sgpt_table1"):
        _cfg(outputs=["sgpt_table99"])


def test_headline_is_each_papers_list_with_table_parts():
    cfg = _cfg(papers=ALL_PAPERS, outputs="headline")
    expected = {}
    for paper in ALL_PAPERS:
        doc = yaml.safe_load((ROOT / "config" / "reports" / f"{paper}.yaml").read_text())
        assert doc.get("headline"), f"{paper} has no headline outputs"
        expected.update(dict.fromkeys(x if isinstance(x, str) else x["output"] for x in doc["headline"]))
    assert cfg.outputs == list(expected)
    assert set(cfg.reports) == set(ALL_PAPERS)
    for paper in ALL_PAPERS:  # every paper trains something by default
        assert any(cfg.experiments[r["experiment"]]["paper"] == paper for r in cfg.runs()), paper
    picked = chosen_outputs("headline", {p: r["headline"] for p, r in cfg.reports.items()}, cfg.tables, cfg.figures)
    assert cfg.selected == set().union(*[output_runs(n, cfg.tables, cfg.figures, cfg.experiments, part)
                                         for n, parts in picked.items() for part in parts])


def _with_headline(tmp_path: Path, headline: list) -> Path:
    shutil.copytree(ROOT / "config", tmp_path / "config")
    path = tmp_path / "config" / "reports" / "sgpt.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["headline"] = headline
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return tmp_path


def test_headline_needs_every_papers_list(tmp_path):
    root = _with_headline(tmp_path, [])
    with pytest.raises(ConfigError, match=r"outputs: 'headline' builds .*\['sgpt'\] has none"):
        load_config({"scale": "mini", "seeds": [0], "papers": ["sgpt"], "outputs": "headline"}, root)


@pytest.mark.parametrize("headline, needle", [
    (["sgpt_table9"], "headline[0]: 'sgpt_table9' is not one of"),
    ([{"output": "sgpt_fig1", "columns": [0]}], "rows/columns select part of a table; 'sgpt_fig1' is a figure"),
    ([{"output": "sgpt_table1", "columns": ["s=7"]}], "headline[0].columns: 's=7' is neither a column label"),
    ([{"output": "sgpt_table1", "rows": ["nope"]}], "headline[0].rows: 'nope' is not one of"),
])
def test_a_bad_headline_entry_is_an_error_naming_it(tmp_path, headline, needle):
    root = _with_headline(tmp_path, headline)
    with pytest.raises(ConfigError, match="reports/sgpt.yaml") as e:
        load_config({"scale": "mini", "seeds": [0], "papers": ["sgpt"], "outputs": "headline"}, root)
    assert needle in str(e.value)


def test_a_table_part_selects_only_its_cells_and_the_rest_say_not_selected(tmp_path):
    table = load_config({"scale": "mini", "seeds": [0], "papers": ["sgpt"]}, ROOT).tables["sgpt_table1"]
    first = table["columns"][0]
    root = _with_headline(tmp_path, [{"output": "sgpt_table1", "columns": [first["label"]], "rows": ["sgpt"]}])
    cfg = load_config({"scale": "mini", "seeds": [0], "papers": ["sgpt"], "outputs": "headline"}, root)
    assert {(r["experiment"], r["method"]) for r in cfg.runs()} == {(first["experiment"], "sgpt")}
    view = cfg.report_view()
    metrics = pd.DataFrame(columns=["experiment", "method", "seed", "scale", "paper", "round", "split", "client",
                                    "metric", "value"])
    built = build_table(metrics, cfg.tables["sgpt_table1"], view, "mini", set(cfg.implemented_methods()))
    selected = built.loc[(built["row"] == "sgpt") & (built["col_index"] == 0), "status"]
    assert set(selected) == {MISSING_RUN}  # selected, but not run yet
    assert set(built.loc[built["row"] == "head_tune", "status"]) == {NOT_SELECTED}
    inventory = build_inventory(metrics, configured_runs(cfg, "sgpt"), "mini")
    assert set(inventory.loc[inventory["method"] == "head_tune", "status"]) == {RUN_NOT_SELECTED}


def test_a_claim_on_unselected_cells_says_not_selected():
    frame = pd.DataFrame([{"row": r, "row_label": r, "column": "x", "col_index": 0, "method": r,
                           "ours": v, "status": s, "paper": math.nan}
                          for r, v, s in (("a", 80.0, OK), ("b", math.nan, NOT_SELECTED))])
    verdict = greater(Grid(frame, 2), {"predicate": "greater", "row": "a", "than": "b"})
    assert verdict.verdict == NOT_RUN and "not selected" in verdict.detail


def test_a_claim_on_cells_the_scale_does_not_configure_says_not_configured():
    from fedcore.claim_rules import MISSING, NOT_SET_UP, missing_verdict
    from fedcore.report.tables import MISSING_METRIC, NOT_CONFIGURED

    assert missing_verdict({NOT_SELECTED}) == NOT_RUN
    assert missing_verdict({NOT_SELECTED, NOT_CONFIGURED}) == NOT_SET_UP       # no outputs choice fills these
    assert missing_verdict({NOT_CONFIGURED, MISSING_RUN}) == MISSING            # a configured run without metrics
    assert missing_verdict({MISSING_METRIC}) == MISSING
    frame = pd.DataFrame([{"row": r, "row_label": r, "column": "x", "col_index": 0, "method": r, "paper": math.nan,
                           "ours": v, "status": s} for r, v, s in [("a", 1.0, OK), ("b", math.nan, NOT_CONFIGURED)]])
    grid = Grid(frame, 2)
    verdict = greater(grid, {"row": "a", "than": ["b"], "columns": ["x"]})
    assert verdict.verdict == NOT_SET_UP and "not configured: b [x]" in verdict.detail


def test_claim_cells_are_the_cells_a_predicate_reads():
    from fedcore.claim_rules import claim_cells
    from fedcore.claim_rules import claim_runs

    tables = {"t": TABLE}
    exps = {e: {"methods": ["a", "b", "a_v2"]} for e in ("x1", "x2", "y1", "y2")}
    best = {"table": "t", "predicate": "best_in_column", "row": "a", "rows": ["a", "c"], "columns": ["X2"]}
    assert claim_cells(best, tables, {}) == [("a", "X2"), ("c", "X2")]
    assert claim_runs(best, tables, {}, exps) == {("x2", "a"), ("y2", "a_v2")}   # c reads its row source
    greater_ = {"table": "t", "predicate": "greater", "column": "X1", "than": "X2", "rows": ["b"]}
    assert claim_runs(greater_, tables, {}, exps) == {("x1", "b"), ("x2", "b")}
    assert claim_runs(greater_, tables, {}, {"x1": {"methods": ["b"]}, "x2": {"methods": []}}) == {("x1", "b")}
    sweep = {"kind": "sweep", "experiment": "e", "series": [
        {"label": "s", "metric": "global_acc", "points": [{"value": 1, "method": "m1"},
                                                          {"value": 2, "method": "m2", "experiment": "f"},
                                                          {"value": 3, "method": "m3"}]}]}
    mono = {"figure": "f", "predicate": "monotone", "along": "rows", "rows": [1, 2], "direction": "increasing"}
    assert claim_runs(mono, {}, {"f": sweep}, {"e": {"methods": ["m1", "m3"]}, "f": {"methods": ["m2"]}}) \
        == {("e", "m1"), ("f", "m2")}


def test_outputs_claims_trains_exactly_the_runs_the_claims_read():
    cfg = _cfg(outputs="claims")
    claims = cfg.reports["sgpt"]["claims"]
    assert set(cfg.outputs) == {c.get("table") or c["figure"] for c in claims}
    needed = {(r["experiment"], r["method"]) for r in cfg.runs()}
    # Table 1's claims read its rows; Fig. 6a's key-momentum runs feed no claim
    assert ("sgpt_c100_s10", "fedpr") in needed and ("sgpt_c100_s10", "sgpt_ak0p9") not in needed
    # Fig. 6b's sweep reads its alpha_g points; Fig. 4's its blocks
    assert ("sgpt_c100_s10", "sgpt_ag0p9") in needed and ("sgpt_c100_s10", "sgpt_shared_to3") in needed
    every = {(r["experiment"], r["method"]) for r in _cfg(outputs="all").runs()}
    assert needed < every


def test_the_run_inventory_names_a_variant_no_table_shows_by_its_label():
    from fedcore.report.inventory import method_labels

    assert method_labels(_cfg(papers=("fedhpl",), outputs="headline"), "fedhpl")["hpl_bs32"] == "batch 32"
