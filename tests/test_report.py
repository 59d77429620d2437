"""Tests for fedcore.report: aggregation, tables and figures, on small synthetic metrics."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedcore.report.aggregate import METRIC_COLUMNS, aggregate_runs, empty_metrics, validate_metrics
from fedcore.report.figures import make_figure, plot_accuracy_per_round
from fedcore.report.tables import (
    MINI_NOTE, MISSING_METRIC, MISSING_RUN, NOT_CONFIGURED, NOT_IMPLEMENTED, OK,
    build_table, latex_escape, render_latex, render_markdown, window_value, write_table,
)


# ----------------------------------------------------------------------------------------------
# Synthetic data
# ----------------------------------------------------------------------------------------------

def run_frame(experiment: str, method: str, seed: int, accs: dict[int, float], scale: str = "mini",
              n_clients: int = 2) -> pd.DataFrame:
    """One run's metrics: global acc = accs[r], local mean = acc - 0.01, worst = acc - 0.1, per client."""
    rows = []
    for rnd, acc in accs.items():
        entries = [(-1, "global", "acc", acc), (-1, "local", "acc_mean", acc - 0.01),
                   (-1, "local", "acc_worst", acc - 0.1), (-1, "train", "loss", 1.0 / rnd)]
        entries += [(i, "local", "acc", acc - 0.02 * i) for i in range(n_clients)]
        for client, split, metric, value in entries:
            rows.append({"paper": "sgpt", "experiment": experiment, "method": method, "scale": scale,
                         "dataset": "digits", "seed": seed, "round": rnd, "client": client,
                         "split": split, "metric": metric, "value": value})
    return pd.DataFrame(rows).astype({"seed": "int64", "round": "int64", "client": "int64",
                                      "value": "float64"})


def ramp(n_rounds: int, start: float = 0.5, step: float = 0.05) -> dict[int, float]:
    """Accuracies start, start+step, ... for rounds 1..n_rounds."""
    return {r: start + step * (r - 1) for r in range(1, n_rounds + 1)}


EXPERIMENTS = {
    "exp_a": {"methods": ["fedavg", "local", "head_tune"], "report": {"window": "last", "rounds": 3},
              "federation": {"rounds": 6}},
    "exp_b": {"methods": ["fedavg", "head_tune"], "report": {"window": "best"}},
}
IMPLEMENTED = {"fedavg", "local", "head_tune", "fedvpt"}
TABLE_CFG = {
    "caption": "Test table: accuracy (%), mean of the report window.",
    "rows": ["fedavg", "head_tune", "fedvpt", "local", "sgpt"],
    "columns": [
        {"label": "A Global", "experiment": "exp_a", "metric": "global_acc"},
        {"label": "A Worst", "experiment": "exp_a", "metric": "worst_local_acc"},
        {"label": "B Local", "experiment": "exp_b", "metric": "local_acc"},
        {"label": "A client 1", "experiment": "exp_a", "metric": "client_acc", "client": 1},
        {"label": "A client 7", "experiment": "exp_a", "metric": "client_acc", "client": 7},
    ],
    "paper": {
        "fedavg": [80.0, 70.0, 81.0, None, None],
        "head_tune": [76.69, 65.96, 75.0, None, None],
        "sgpt": [86.72, 77.56, 84.64, None, None],
    },
}


def sample_metrics(scale: str = "mini") -> pd.DataFrame:
    """fedavg: 3 seeds on exp_a (6 rounds) and exp_b; head_tune: 1 seed, short on exp_a; local: none."""
    frames = [run_frame("exp_a", "fedavg", s, ramp(6, start=0.5 + 0.02 * s), scale) for s in range(3)]
    frames += [run_frame("exp_b", "fedavg", s, ramp(4, start=0.6 + 0.02 * s), scale) for s in range(3)]
    frames.append(run_frame("exp_a", "head_tune", 0, {5: 0.7, 6: 0.8}, scale))  # 2 evaluated rounds < 3
    frames.append(run_frame("exp_b", "head_tune", 0, ramp(3, start=0.4), scale))
    frames.append(run_frame("exp_a", "fedvpt", 0, ramp(6), scale))  # not configured: must be ignored
    return pd.concat(frames, ignore_index=True)


def cell(table: pd.DataFrame, row: str, column: str) -> pd.Series:
    """The one table cell at (row, column label)."""
    match = table.loc[(table["row"] == row) & (table["column"] == column)]
    assert len(match) == 1
    return match.iloc[0]


# ----------------------------------------------------------------------------------------------
# Window arithmetic and seed statistics
# ----------------------------------------------------------------------------------------------

def test_window_last_k_mean():
    series = pd.Series([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], index=[1, 2, 3, 4, 5, 6])
    value, used, short = window_value(series, {"window": "last", "rounds": 3})
    assert value == pytest.approx(0.5) and used == 3 and not short


def test_window_last_k_uses_round_order_not_row_order():
    series = pd.Series([0.6, 0.1, 0.5, 0.2], index=[6, 1, 5, 2])
    value, _, _ = window_value(series, {"window": "last", "rounds": 2})
    assert value == pytest.approx(0.55)


def test_window_best_is_max():
    series = pd.Series([0.3, 0.9, 0.4], index=[1, 2, 3])
    value, used, short = window_value(series, {"window": "best"})
    assert value == pytest.approx(0.9) and used == 3 and not short


def test_window_short_uses_what_exists_and_flags():
    series = pd.Series([0.7, 0.8], index=[5, 6])
    value, used, short = window_value(series, {"window": "last", "rounds": 3})
    assert value == pytest.approx(0.75) and used == 2 and short


def test_bad_window_raises():
    with pytest.raises(ValueError, match="window"):
        window_value(pd.Series([0.1], index=[1]), {"window": "median"})
    with pytest.raises(ValueError, match="rounds"):
        window_value(pd.Series([0.1], index=[1]), {"window": "last", "rounds": 0})


def test_mean_and_std_over_seeds():
    table = build_table(sample_metrics(), TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    c = cell(table, "fedavg", "A Global")
    # Seed s: last 3 of 0.5+0.02s + 0.05*(r-1), r=4..6 -> 0.70 + 0.02s; seeds -> 70, 72, 74 (%).
    assert c["ours"] == pytest.approx(72.0)
    assert c["ours_std"] == pytest.approx(2.0)  # sample std, ddof=1
    assert c["n_seeds"] == 3 and c["status"] == OK and c["rounds_used"] == 3
    assert not c["short_window"] and not c["incomplete"]
    worst = cell(table, "fedavg", "A Worst")
    assert worst["ours"] == pytest.approx(62.0)
    client1 = cell(table, "fedavg", "A client 1")
    assert client1["ours"] == pytest.approx(70.0)
    best = cell(table, "fedavg", "B Local")  # best of local mean: 0.6+0.02s+0.15-0.01
    assert best["ours"] == pytest.approx(76.0) and best["window"] == "best"


def test_single_seed_has_no_std_and_short_window_flagged():
    table = build_table(sample_metrics(), TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    c = cell(table, "head_tune", "A Global")
    assert c["ours"] == pytest.approx(75.0) and math.isnan(c["ours_std"])
    assert c["n_seeds"] == 1 and c["short_window"] and c["rounds_used"] == 2
    md = render_markdown(table, TABLE_CFG, "mini")
    assert "75.00 (n=1)†" in md
    assert "† fewer evaluated rounds than the report window" in md


def test_incomplete_run_flagged():
    metrics = pd.concat([run_frame("exp_a", "fedavg", 0, ramp(4))], ignore_index=True)  # 4 < 6 rounds
    table = build_table(metrics, TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    c = cell(table, "fedavg", "A Global")
    assert c["incomplete"] and not c["short_window"]
    assert "‡" in render_markdown(table, TABLE_CFG, "mini")


# ----------------------------------------------------------------------------------------------
# Status strings, paper numbers, scales
# ----------------------------------------------------------------------------------------------

def test_every_status_string():
    table = build_table(sample_metrics(), TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    assert cell(table, "sgpt", "A Global")["status"] == NOT_IMPLEMENTED
    assert cell(table, "fedvpt", "A Global")["status"] == NOT_CONFIGURED  # has rows, still not shown
    assert cell(table, "local", "A Global")["status"] == MISSING_RUN
    assert cell(table, "local", "B Local")["status"] == NOT_CONFIGURED
    assert cell(table, "fedavg", "A client 7")["status"] == MISSING_METRIC
    for status in (NOT_IMPLEMENTED, NOT_CONFIGURED, MISSING_RUN, MISSING_METRIC):
        rows = table.loc[table["status"] == status]
        assert rows["ours"].isna().all() and (rows["n_seeds"] == 0).all()
    md = render_markdown(table, TABLE_CFG, "mini")
    for text in ("not implemented", "not configured", "missing run", "missing metric"):
        assert f"| {text} |" in md


def test_table_order_and_paper_numbers():
    table = build_table(sample_metrics(), TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    assert list(table["row"].drop_duplicates()) == TABLE_CFG["rows"]
    assert list(table.loc[table["row"] == "fedavg", "column"]) == [c["label"] for c in TABLE_CFG["columns"]]
    assert cell(table, "head_tune", "A Global")["paper"] == pytest.approx(76.69)
    assert math.isnan(cell(table, "fedavg", "A client 1")["paper"])  # null in config
    assert math.isnan(cell(table, "local", "A Global")["paper"])  # row absent from paper block
    assert "| — |" in render_markdown(table, TABLE_CFG, "mini")


def test_diff_only_at_paper_scale():
    mini = build_table(sample_metrics("mini"), TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    assert mini["diff"].isna().all()
    assert "Δ" not in render_markdown(mini, TABLE_CFG, "mini").split("\n")[2]
    paper = build_table(sample_metrics("paper"), TABLE_CFG, EXPERIMENTS, "paper", IMPLEMENTED)
    assert cell(paper, "fedavg", "A Global")["diff"] == pytest.approx(72.0 - 80.0)
    assert math.isnan(cell(paper, "fedavg", "A client 1")["diff"])  # no paper number
    md = render_markdown(paper, TABLE_CFG, "paper")
    assert "A Global: Δ" in md and "-8.00" in md and MINI_NOTE not in md


def test_scale_filters_rows():
    # Paper-scale runs must not fill a mini table.
    table = build_table(sample_metrics("paper"), TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    assert cell(table, "fedavg", "A Global")["status"] == MISSING_RUN


def test_mini_header_marks_paper_as_reference(tmp_path: Path):
    table = build_table(sample_metrics(), TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    out = [tmp_path / "t.md", tmp_path / "t.tex", tmp_path / "t.csv"]
    write_table(table, TABLE_CFG, "mini", *out)
    md, tex, csv = (p.read_text(encoding="utf-8") for p in out)
    assert "A Global: paper (layout ref.)" in md and MINI_NOTE in md.split("\n")[0]
    assert "paper (layout ref.)" in tex and "reference for layout only" in tex
    back = pd.read_csv(out[2])
    assert (back["paper_role"] == "layout reference only (data and backbone differ)").all()
    assert back["diff"].isna().all()


def test_csv_round_trips_numbers(tmp_path: Path):
    table = build_table(sample_metrics("paper"), TABLE_CFG, EXPERIMENTS, "paper", IMPLEMENTED)
    out = [tmp_path / "t.md", tmp_path / "t.tex", tmp_path / "t.csv"]
    write_table(table, TABLE_CFG, "paper", *out)
    back = pd.read_csv(out[2])
    assert list(back.columns) == list(table.columns)
    np.testing.assert_allclose(back["ours"], table["ours"], rtol=1e-5)
    assert list(back["status"]) == list(table["status"])
    assert list(back["n_seeds"]) == list(table["n_seeds"])


def test_best_of_ours_is_bold():
    table = build_table(sample_metrics(), TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    md = render_markdown(table, TABLE_CFG, "mini")
    fedavg = next(line for line in md.splitlines() if line.startswith("| fedavg"))
    head_tune = next(line for line in md.splitlines() if line.startswith("| head_tune"))
    # A Global: head_tune 75.00 > fedavg 72.00; B Local: fedavg 76.00 > head_tune 49.00.
    assert "| **75.00 (n=1)†** |" in head_tune and "| 72.00 ± 2.00 |" in fedavg
    assert "| **76.00 ± 2.00** |" in fedavg and "| 49.00 (n=1) |" in head_tune
    assert "**not" not in md and "**missing" not in md  # statuses are never bold


def test_latex_is_escaped_booktabs():
    table = build_table(sample_metrics("paper"), TABLE_CFG, EXPERIMENTS, "paper", IMPLEMENTED)
    tex = render_latex(table, TABLE_CFG, "paper", label="sgpt_table1")
    assert r"\begin{table}" in tex and r"\toprule" in tex and r"\bottomrule" in tex
    assert r"\caption{Test table: accuracy (\%)" in tex
    assert r"head\_tune" in tex and "head_tune" not in tex.replace(r"head\_tune", "")
    assert r"\label{tab:sgpt\_table1}" in tex and r"$\Delta$" in tex and r"$\pm$" in tex
    assert latex_escape("a_b & 50% #1 {x}") == r"a\_b \& 50\% \#1 \{x\}"


def test_bad_config_raises():
    bad = dict(TABLE_CFG, paper={"fedavg": [1.0, 2.0]})
    with pytest.raises(ValueError, match="fedavg"):
        build_table(sample_metrics(), bad, EXPERIMENTS, "mini", IMPLEMENTED)
    bad = dict(TABLE_CFG, paper={}, columns=[{"label": "X", "experiment": "nope", "metric": "global_acc"}])
    with pytest.raises(ValueError, match="nope"):
        build_table(sample_metrics(), bad, EXPERIMENTS, "mini", IMPLEMENTED)
    bad = dict(TABLE_CFG, paper={}, columns=[{"label": "X", "experiment": "exp_a", "metric": "client_acc"}])
    with pytest.raises(ValueError, match="client"):
        build_table(sample_metrics(), bad, EXPERIMENTS, "mini", IMPLEMENTED)


# ----------------------------------------------------------------------------------------------
# Aggregation and validation
# ----------------------------------------------------------------------------------------------

def test_validate_accepts_good_frame():
    validate_metrics(run_frame("exp_a", "fedavg", 0, ramp(2)), "run.parquet")


@pytest.mark.parametrize("mutate, column", [
    (lambda df: df.drop(columns=["client"]), "client"),
    (lambda df: df.assign(extra=1.0), "extra"),
    (lambda df: df.astype({"seed": "float64"}), "seed"),
    (lambda df: df.astype({"value": "float32"}), "value"),
    (lambda df: df.assign(method=1), "method"),
    (lambda df: df.assign(scale="huge"), "scale"),
    (lambda df: df.assign(round=0), "round"),
])
def test_validate_errors_name_column_and_file(mutate, column):
    df = mutate(run_frame("exp_a", "fedavg", 0, ramp(2)))
    with pytest.raises(ValueError) as err:
        validate_metrics(df, "results/runs/x.parquet")
    assert column in str(err.value) and "results/runs/x.parquet" in str(err.value)


def write_runs(tmp_path: Path) -> list[Path]:
    """Two valid run files."""
    paths = []
    for seed in (0, 1):
        path = tmp_path / f"run{seed}.parquet"
        run_frame("exp_a", "fedavg", seed, ramp(3)).to_parquet(path, index=False)
        paths.append(path)
    return paths


def test_aggregate_writes_parquet_that_reads_back_equal(tmp_path: Path):
    out = tmp_path / "agg" / "metrics.parquet"
    agg = aggregate_runs(write_runs(tmp_path), out)
    assert list(agg.columns) == METRIC_COLUMNS and len(agg) == 2 * len(run_frame("e", "m", 0, ramp(3)))
    pd.testing.assert_frame_equal(pd.read_parquet(out), agg)
    assert sorted(p.name for p in out.parent.iterdir()) == ["metrics.parquet"]  # no temp left


def test_aggregate_of_nothing_is_empty_with_schema(tmp_path: Path):
    out = tmp_path / "metrics.parquet"
    agg = aggregate_runs([], out)
    assert agg.empty and list(agg.columns) == METRIC_COLUMNS
    pd.testing.assert_frame_equal(pd.read_parquet(out), empty_metrics(), check_dtype=False)


def test_nothing_written_when_validation_fails(tmp_path: Path):
    paths = write_runs(tmp_path)
    bad = tmp_path / "bad.parquet"
    run_frame("exp_a", "fedavg", 2, ramp(3)).drop(columns=["split"]).to_parquet(bad, index=False)
    out_dir = tmp_path / "out"
    with pytest.raises(ValueError, match="split"):
        aggregate_runs(paths + [bad], out_dir / "metrics.parquet")
    assert not out_dir.exists() or list(out_dir.iterdir()) == []


def test_duplicate_runs_rejected(tmp_path: Path):
    paths = write_runs(tmp_path)
    out = tmp_path / "out" / "metrics.parquet"
    with pytest.raises(ValueError, match="duplicate"):
        aggregate_runs(paths + paths[:1], out)
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------

FIG_CFG = {"kind": "accuracy_per_round", "caption": "Global accuracy per round.",
           "experiments": ["exp_a", "exp_b", "exp_empty"], "metric": "global_acc"}


def test_figure_writes_png_and_pdf(tmp_path: Path):
    png, pdf = tmp_path / "fig" / "f.png", tmp_path / "fig" / "f.pdf"
    plot_accuracy_per_round(sample_metrics(), FIG_CFG, png, pdf)
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pdf.stat().st_size > 0 and pdf.read_bytes()[:5] == b"%PDF-"
    assert sorted(p.name for p in png.parent.iterdir()) == ["f.pdf", "f.png"]


def test_figure_panels_lines_and_no_runs():
    fig = make_figure(sample_metrics(), FIG_CFG)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["exp_a", "exp_b", "exp_empty"]
    assert len(axes[0].get_lines()) == 3  # fedavg, fedvpt, head_tune
    assert len(axes[0].collections) == 1  # only fedavg has >1 seed, so only it gets a band
    assert [t.get_text() for t in axes[2].texts] == ["no runs"]
    fedavg = next(line for line in axes[0].get_lines() if line.get_label().startswith("fedavg"))
    np.testing.assert_allclose(fedavg.get_ydata(), [52 + 5 * r for r in range(6)])


def test_figure_limits_to_configured_methods():
    experiments = dict(EXPERIMENTS, exp_empty={"methods": ["fedavg"], "report": {"window": "best"}})
    fig = make_figure(sample_metrics(), FIG_CFG, experiments=experiments)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["fedavg (n=3)", "head_tune (n=1)"]  # fedvpt is not configured for exp_a
    colors = {ax.get_title(): {l.get_label().split()[0]: l.get_color() for l in ax.get_lines()}
              for ax in fig.axes[:2]}
    assert colors["exp_a"]["head_tune"] == colors["exp_b"]["head_tune"]  # same colour in every panel
    with pytest.raises(ValueError, match="exp_empty"):
        make_figure(sample_metrics(), FIG_CFG, experiments=EXPERIMENTS)


def test_figure_marks_the_round_a_method_diverged_and_says_so_under_the_panels():
    from fedcore.report.plotting import figure_notes
    metrics = sample_metrics()
    # seed 1's fedavg on exp_a held NaN/inf from round 3 on (the engine's row: client -1, split train)
    bad = metrics.loc[(metrics["experiment"] == "exp_a") & (metrics["method"] == "fedavg") & (metrics["seed"] == 1)
                      & (metrics["metric"] == "acc") & (metrics["split"] == "global") & (metrics["round"] >= 3)]
    rows = bad.assign(split="train", metric="diverged", value=2.0)
    fig = make_figure(pd.concat([metrics, rows], ignore_index=True), FIG_CFG)
    exp_a, exp_b = fig.axes[0], fig.axes[1]
    dotted = [line for line in exp_a.get_lines() if line.get_linestyle() == ":"]
    assert len(dotted) == 1 and list(dotted[0].get_xdata()) == [3, 3]
    fedavg = next(line for line in exp_a.get_lines() if line.get_label().startswith("fedavg"))
    assert dotted[0].get_color() == fedavg.get_color()
    assert [t.get_text() for t in exp_a.texts] == ["!"]
    assert not exp_b.texts and not [line for line in exp_b.get_lines() if line.get_linestyle() == ":"]
    notes = figure_notes(fig)
    assert "Diverged (dotted line): exp_a: fedavg from round 3." in notes and "! a run's trained state" in notes
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [  # the dotted line has no entry
        "fedavg (n=3)", "fedvpt (n=1)", "head_tune (n=1)"]
    assert "Diverged" not in figure_notes(make_figure(metrics, FIG_CFG))  # healthy runs: no note, no line


def test_figure_refuses_mixed_scales(tmp_path: Path):
    mixed = pd.concat([sample_metrics("mini"), sample_metrics("paper")], ignore_index=True)
    with pytest.raises(ValueError, match="scale"):
        plot_accuracy_per_round(mixed, FIG_CFG, tmp_path / "f.png", tmp_path / "f.pdf")
    assert list(tmp_path.iterdir()) == []
    make_figure(mixed, FIG_CFG, scale="paper")  # picking one is fine
