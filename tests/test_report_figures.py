"""SGPT's paper figures on small synthetic inputs: numbers drawn, layout, and visible missing markers."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgb

from fedcore.report.fig_metrics import (
    OURS_COLOR, PFL_COLOR, best_baselines, scatter_figure, scatter_points, selection_figure, selection_stats,
    sweep_figure, sweep_points,
)
from fedcore.report.fig_probes import (congruence_figure, congruence_summary, partition_figure,
                                      partition_grid_figure)
from fedcore.report.plotting import figure_notes
from fedcore.report.render import render_figure, render_table
from fedcore.report.tables import MISSING_METRIC, MISSING_RUN, NOT_CONFIGURED, NOT_IMPLEMENTED, OK


# ----------------------------------------------------------------------------------------------
# Synthetic metrics
# ----------------------------------------------------------------------------------------------

def frame(rows: list[tuple], experiment: str = "exp", scale: str = "mini") -> pd.DataFrame:
    """Metrics rows from (method, seed, round, client, split, metric, value) tuples."""
    df = pd.DataFrame(rows, columns=["method", "seed", "round", "client", "split", "metric", "value"])
    df.insert(0, "paper", "sgpt")
    df.insert(1, "experiment", experiment)
    df.insert(3, "scale", scale)
    df.insert(4, "dataset", "digits")
    return df.astype({"seed": "int64", "round": "int64", "client": "int64", "value": "float64"})


def acc_rows(method: str, glob: float, worst: float, seed: int = 0, rounds: int = 3) -> list[tuple]:
    """Constant global/local/worst accuracies every round."""
    out = []
    for r in range(1, rounds + 1):
        out += [(method, seed, r, -1, "global", "acc", glob), (method, seed, r, -1, "local", "acc_mean", glob),
                (method, seed, r, -1, "local", "acc_worst", worst)]
    return out


def experiments(methods: list[str]) -> dict[str, dict]:
    """A report_view with one experiment, window = last 2 of 3 rounds."""
    return {"exp": {"methods": methods, "report": {"window": "last", "rounds": 2}, "paper": "sgpt", "rounds": 3,
                    "dataset": "digits"}}


def points_of(ax) -> list[PathCollection]:
    """The scatter collections of an axes (not error-bar line collections)."""
    return [c for c in ax.collections if isinstance(c, PathCollection) and len(c.get_offsets())]


IMPLEMENTED = {"head_tune", "pfedpg", "sgpt", "sgpt_qg", "sgpt_no_momentum", "sgpt_ag0", "sgpt_ag0p9"}


# ----------------------------------------------------------------------------------------------
# Fig. 1 scatter
# ----------------------------------------------------------------------------------------------

SCATTER = {"kind": "scatter", "caption": "Fig. 1", "experiment": "exp", "x_metric": "global_acc",
           "y_metric": "worst_local_acc", "highlight": "sgpt",
           "methods": ["head_tune", "pfedpg", "sgpt", "fedmix", "fedpr"],
           "labels": {"head_tune": "Head-Tune", "pfedpg": "pFedPG", "sgpt": "SGPT", "fedmix": "FedMix", "fedpr": "FedPR"},
           "paper": {"sgpt": [84.64, 73.85]}}


def scatter_metrics() -> pd.DataFrame:
    rows = acc_rows("head_tune", 0.70, 0.50) + acc_rows("pfedpg", 0.75, 0.65) + acc_rows("sgpt", 0.80, 0.70)
    rows += acc_rows("sgpt", 0.84, 0.72, seed=1)
    return frame(rows)


def test_scatter_points_values_and_statuses():
    exps = experiments(["head_tune", "pfedpg", "sgpt", "fedpr"])
    pts = scatter_points(scatter_metrics(), SCATTER, exps, "mini", IMPLEMENTED | {"fedpr"}).set_index("method")
    assert pts.loc["head_tune", ["x", "y"]].tolist() == pytest.approx([70.0, 50.0])
    assert pts.loc["sgpt", "x"] == pytest.approx(82.0) and pts.loc["sgpt", "x_std"] == pytest.approx(math.sqrt(8))
    assert pts.loc["fedmix", "status"] == NOT_IMPLEMENTED
    assert pts.loc["fedpr", "status"] == MISSING_RUN


def test_scatter_marks_ours_pfl_and_lists_missing():
    exps = experiments(["head_tune", "pfedpg", "sgpt"])
    fig = scatter_figure(scatter_metrics(), SCATTER, exps, "mini", IMPLEMENTED,
                         personalized={"head_tune": False, "pfedpg": True, "sgpt": False})
    ax = fig.axes[0]
    faces = [tuple(np.round(c.get_facecolor()[0][:3], 3)) for c in points_of(ax)]
    assert tuple(np.round(to_rgb(OURS_COLOR), 3)) in faces and tuple(np.round(to_rgb(PFL_COLOR), 3)) in faces
    assert len(points_of(ax)) == 3  # no paper point at mini
    notes = figure_notes(fig)
    assert "FedMix (not implemented)" in notes and "FedPR (not implemented)" in notes
    paper = scatter_figure(frame([]), SCATTER, exps, "paper", IMPLEMENTED)
    assert "no runs" in [t.get_text() for t in paper.axes[0].texts]
    assert any(np.allclose(c.get_offsets(), [[84.64, 73.85]]) for c in points_of(paper.axes[0]))


def test_scatter_labels_never_overlap_and_points_on_one_spot_share_a_label():
    """SGPT Fig. 1 at mini printed FedMix on top of FedVPT: equal points now share one label, close points get
    labels that cover neither each other nor a marker."""
    methods = ["head_tune", "pfedpg", "sgpt", "fedmix", "fedpr"]
    rows = (acc_rows("head_tune", 0.850, 0.400) + acc_rows("fedmix", 0.851, 0.366) + acc_rows("fedpr", 0.851, 0.366)
            + acc_rows("pfedpg", 0.853, 0.380) + acc_rows("sgpt", 0.744, 0.189))
    fig = scatter_figure(frame(rows), SCATTER, experiments(methods), "mini", set(methods))
    ax = fig.axes[0]
    fig.canvas.draw()
    texts = [t for t in ax.texts if t.get_text()]
    assert sorted(t.get_text() for t in texts) == ["FedMix, FedPR", "Head-Tune", "SGPT", "pFedPG"]
    boxes = [t.get_window_extent() for t in texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    markers = [ax.transData.transform(c.get_offsets()[0]) for c in points_of(ax)]
    assert not any(b.contains(*m) for b in boxes for m in markers)
    frame_box = ax.get_window_extent()
    assert all(frame_box.contains(b.x0, b.y0) and frame_box.contains(b.x1, b.y1) for b in boxes)


# ----------------------------------------------------------------------------------------------
# Fig. 3 selection counts
# ----------------------------------------------------------------------------------------------

def select_rows(method: str, per_round: list[list[float]], seed: int = 0, client: int = 0) -> list[tuple]:
    return [(method, seed, r + 1, client, "train", f"select_g{g:02d}", v)
            for r, counts in enumerate(per_round) for g, v in enumerate(counts)]


SELECT = {"kind": "selection_counts", "experiment": "exp", "client": 0, "caption": "Fig. 3",
          "panels": [{"label": "(a) without momentum", "method": "sgpt_no_momentum"},
                     {"label": "(b) with momentum", "method": "sgpt"}]}


def test_selection_stats_mean_std_over_rounds_of_lowest_seed():
    rows = select_rows("sgpt", [[10, 0, 5], [20, 2, 5], [30, 4, 5]], seed=1)
    rows += select_rows("sgpt", [[99, 99, 99]], seed=2) + acc_rows("sgpt", 0.8, 0.7, seed=1)
    stats, info = selection_stats(frame(rows), "exp", experiments(["sgpt"])["exp"], "sgpt", 0, "mini", IMPLEMENTED)
    assert info == {"status": OK, "seed": 1, "rounds": 3}
    assert stats["group"].tolist() == [0, 1, 2]
    np.testing.assert_allclose(stats["mean"], [20, 2, 5])
    np.testing.assert_allclose(stats["std"], [10, 2, 0])


def test_selection_figure_missing_panel_is_visible():
    rows = select_rows("sgpt", [[10, 0], [20, 2]]) + acc_rows("sgpt_no_momentum", 0.5, 0.4)
    fig = selection_figure(frame(rows), SELECT, experiments(["sgpt", "sgpt_no_momentum"]), "mini", IMPLEMENTED)
    a, b = fig.axes[:2]
    assert "no selection counts" in a.texts[0].get_text() and MISSING_METRIC in a.texts[0].get_text()
    assert [round(p.get_height(), 6) for p in b.patches] == [15.0, 1.0]
    assert "(a) without momentum: sgpt_no_momentum (missing metric)" in figure_notes(fig)


# ----------------------------------------------------------------------------------------------
# Figs. 4 / 6b sweeps
# ----------------------------------------------------------------------------------------------

SWEEP = {"kind": "sweep", "experiment": "exp", "param_label": "α_g", "param_axis": "y", "reference": 0.5,
         "caption": "Fig. 6b", "baselines": ["head_tune", "pfedpg"],
         "series": [{"label": "global", "metric": "global_acc", "color": "tab:blue",
                     "points": [{"value": 0.9, "method": "sgpt_ag0p9"}, {"value": 0.0, "method": "sgpt_ag0"},
                                {"value": 0.5, "method": "sgpt"}]},
                    {"label": "worst", "metric": "worst_local_acc", "color": "tab:red",
                     "points": [{"value": 0.0, "method": "sgpt_ag0"}, {"value": 0.5, "method": "sgpt"}]}]}


def sweep_metrics() -> pd.DataFrame:
    rows = acc_rows("sgpt_ag0", 0.80, 0.60) + acc_rows("sgpt", 0.84, 0.70)
    rows += acc_rows("head_tune", 0.70, 0.66) + acc_rows("pfedpg", 0.75, 0.55)
    return frame(rows)


def test_sweep_points_sorted_with_statuses():
    exps = experiments(["sgpt_ag0", "sgpt", "head_tune", "pfedpg"])
    pts = sweep_points(sweep_metrics(), SWEEP, exps, "mini", IMPLEMENTED)
    first = pts.loc[pts["series"] == 0]
    assert first["value"].tolist() == [0.0, 0.5, 0.9]
    assert first["y"].iloc[:2].tolist() == pytest.approx([80.0, 84.0])
    assert first["status"].tolist() == [OK, OK, NOT_CONFIGURED]
    best = best_baselines(sweep_metrics(), SWEEP, exps, "mini", IMPLEMENTED)
    assert best["global_acc"] == ("pfedpg", pytest.approx(75.0))
    assert best["worst_local_acc"] == ("head_tune", pytest.approx(66.0))


def test_sweep_figure_param_on_y_with_reference_and_baselines():
    exps = experiments(["sgpt_ag0", "sgpt", "head_tune", "pfedpg"])
    fig = sweep_figure(sweep_metrics(), SWEEP, exps, "mini", IMPLEMENTED)
    ax = fig.axes[0]
    lines = {l.get_label(): l for l in ax.get_lines()}
    glob = next(c.lines[0] for c in ax.containers if c.get_label() == "global")
    np.testing.assert_allclose(glob.get_xdata(), [80.0, 84.0])  # accuracy on x
    np.testing.assert_allclose(glob.get_ydata(), [0.0, 0.5])    # α_g on y
    ref = lines["α_g = 0.5"]
    assert list(ref.get_ydata()) == [0.5, 0.5]  # horizontal
    base = [l for name, l in lines.items() if name.startswith("best baseline")]
    assert sorted(l.get_xdata()[0] for l in base) == pytest.approx([66.0, 75.0])  # vertical
    assert "global at 0.9 (sgpt_ag0p9) (not configured)" in figure_notes(fig)
    assert ax.get_xlabel() == "accuracy (%)" and ax.get_ylabel() == "α_g"


def test_sweep_without_baseline_numbers_says_so():
    fig = sweep_figure(frame(acc_rows("sgpt", 0.84, 0.70)), SWEEP, experiments(["sgpt"]), "mini", IMPLEMENTED)
    assert "best-baseline line for global accuracy (%) (no baseline run has a number)" in figure_notes(fig)


# ----------------------------------------------------------------------------------------------
# Fig. 6a congruence, Fig. 7 partition counts
# ----------------------------------------------------------------------------------------------

CONG = {"kind": "congruence", "experiment": "exp", "param_label": "α_k", "caption": "Fig. 6a",
        "points": [], "paper": [{"value": 0.5, "y": 86.8}], "labels": {"sgpt": "SGPT"}}


def congruence_values() -> pd.DataFrame:
    rows = [(0.0, "sgpt_qg", 0, OK, 0.5), (0.5, "sgpt", 0, OK, 0.80), (0.5, "sgpt", 1, OK, 0.90),
            (0.9, "sgpt_ak0p9", 0, "missing run", math.nan), (0.7, "sgpt_ak0p7", 0, OK, 0.6),
            (0.7, "sgpt_ak0p7", 1, "missing run", math.nan)]
    df = pd.DataFrame(rows, columns=["value", "method", "seed", "status", "congruence"])
    return df.assign(k=5, labels="coarse", acc_overlap=df["congruence"] * 0.9, q_kmeans=0.9)


def test_congruence_summary_and_figure():
    summary = congruence_summary(congruence_values()).set_index("value")
    assert summary.loc[0.5, "mean"] == pytest.approx(85.0) and summary.loc[0.5, "std"] == pytest.approx(math.sqrt(50))
    assert summary.loc[0.9, "status"] == "missing run" and summary.loc[0.7, "n_seeds"] == 1
    fig = congruence_figure(congruence_values(), CONG, "paper")
    line = fig.axes[0].containers[0].lines[0]
    np.testing.assert_allclose(line.get_ydata(), [50.0, 85.0, 60.0])  # settings 0.0, 0.5, 0.7
    notes = figure_notes(fig)
    assert "0.9 (sgpt_ak0p9) (missing run)" in notes and "0.7 (sgpt_ak0p7) seed 1 (missing run)" in notes
    assert "Q_kmeans = 0.900" in fig.axes[0].get_title()
    assert any(np.allclose(c.get_offsets(), [[0.5, 86.8]]) for c in points_of(fig.axes[0]))


def test_partition_figure_bars_and_missing_client():
    counts = pd.DataFrame({"client": [0, 0, 1, 1, 0], "split": ["train"] * 4 + ["test"],
                           "class": [3, 7, 7, 9, 3], "count": [50, 40, 30, 20, 9]})
    cfg = {"kind": "partition_counts", "experiment": "exp", "clients": [0, 1, 5], "per_panel": 2, "caption": "Fig. 7"}
    fig = partition_figure(counts, cfg, seed=0)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 2
    assert sorted(p.get_height() for p in axes[0].patches if p.get_height() > 0) == [20, 30, 40, 50]
    assert "client 5 (not in the partition)" in figure_notes(fig)
    assert "no such clients" in axes[1].texts[0].get_text()


def test_partition_grid_draws_each_panel_counts_with_its_dataset_in_the_title():
    a = pd.DataFrame({"client": [0, 1, 1, 0], "split": ["train"] * 3 + ["test"], "class": [0, 1, 2, 2],
                      "count": [5, 3, 2, 9]})
    b = pd.DataFrame({"client": [0, 2], "split": ["train", "train"], "class": [1, 0], "count": [4, 6]})
    cfg = {"kind": "partition_grid", "cols": 2, "caption": "Fig. 4",
           "panels": [{"title": "IID", "experiment": "e1"}, {"title": "Dir", "experiment": "e2"}]}
    fig = partition_grid_figure([a, b], cfg, seed=0, experiments={"e1": {"dataset": "digits"}}, scale="mini")
    shown = [im.get_array() for ax in fig.axes for im in ax.images]
    assert len(shown) == 2
    np.testing.assert_array_equal(shown[0].filled(0), [[5, 0, 0], [0, 3, 2]])      # train only; zeros masked
    np.testing.assert_array_equal(shown[1].filled(0), [[0, 4], [0, 0], [6, 0]])
    titles = [ax.get_title() for ax in fig.axes if ax.images]
    assert titles[0].startswith("IID [digits]") and titles[1].startswith("Dir (")  # e2 not in the view: no name
    assert "(partition seed 0)" in " ".join(fig.get_suptitle().split())   # the scale: render_figure adds it
    # one colour scale for all panels (equal colours, equal counts), one colour bar
    assert len({(im.norm.vmin, im.norm.vmax) for ax in fig.axes for im in ax.images}) == 1
    assert sum(1 for ax in fig.axes if ax.get_label() == "<colorbar>") == 1
    # a panel repeating another's counts is said to
    again = partition_grid_figure([a, a.copy()], cfg, experiments={"e1": {"dataset": "digits"},
                                                                   "e2": {"dataset": "digits"}})
    assert "Dir repeats IID at this scale: both read digits with the same partition." in figure_notes(again)
    with pytest.raises(ValueError, match="2 panels but 1"):
        partition_grid_figure([a], cfg)


# ----------------------------------------------------------------------------------------------
# render: kinds dispatch on the config, outputs written atomically
# ----------------------------------------------------------------------------------------------

def test_render_figure_writes_png_pdf(tmp_path: Path):
    path = tmp_path / "metrics.parquet"
    scatter_metrics().to_parquet(path)
    png, pdf = tmp_path / "out" / "f.png", tmp_path / "out" / "f.pdf"
    render_figure(SCATTER, {"metrics": str(path), "code": []}, png, pdf,
                  {"scale": "mini", "experiments": experiments(["head_tune", "pfedpg", "sgpt"]),
                   "implemented": sorted(IMPLEMENTED), "personalized": {}, "seed": 0})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pdf.read_bytes()[:5] == b"%PDF-"
    assert sorted(p.name for p in png.parent.iterdir()) == ["f.pdf", "f.png"]


def test_render_param_table(tmp_path: Path):
    counts = pd.DataFrame({"column": [0, 1], "source": ["torchvision", "method"], "arch": ["resnet18", "vit"],
                           "method": ["", "sgpt"], "experiment": ["", "e"], "num_classes": [100, 100],
                           "trainable": [11_227_812, None], "total": [11_227_812, None],
                           "status": ["ok", "not implemented"], "device": ["meta", None]})
    path = tmp_path / "param_counts.csv"
    counts.to_csv(path, index=False)
    cfg = {"kind": "param_count", "caption": "Table 5",
           "columns": [{"method": "FedAvg", "architecture": "ResNet-18", "paper": 11_000_000, "model": {}},
                       {"method": "Ours", "architecture": "ViT-B/16", "paper": 100_000, "model": {}}]}
    out = [tmp_path / "t.md", tmp_path / "t.tex", tmp_path / "t.csv"]
    render_table(cfg, {"counts": str(path)}, *out, {"scale": "mini"}, out_html=tmp_path / "t.html")
    md = out[0].read_text(encoding="utf-8")
    assert "| Method | FedAvg | Ours |" in md and "| Architecture | ResNet-18 | ViT-B/16 |" in md
    page = (tmp_path / "t.html").read_text(encoding="utf-8")  # the report's page shows the same table
    assert "<strong>11.23M (11,227,812)</strong></td>" in page and ">not implemented</td>" in page
    assert "**11.23M (11,227,812)**" in md and "| not implemented |" in md
    assert "| # Parameters ↓ (paper) | 11M | 0.1M |" in md and "| Δ (M) | +0.23 | — |" in md
    assert r"$\downarrow$" in out[1].read_text(encoding="utf-8")
    back = pd.read_csv(out[2])
    assert back["trainable"].iloc[0] == 11_227_812 and back["diff"].iloc[0] == pytest.approx(227_812)
    with pytest.raises(ValueError, match="param_counts"):
        render_table(dict(cfg, columns=cfg["columns"][:1]), {"counts": str(path)}, *out, {"scale": "mini"})


def test_render_param_table_grid_of_entire_models(tmp_path: Path):
    counts = pd.DataFrame({"column": [0, 1, 2], "source": ["method"] * 3, "arch": ["r18", "r50", "r18"],
                           "method": ["a", "a", "b"], "experiment": ["e"] * 3, "num_classes": [10] * 3,
                           "trainable": [100, 200, 300], "total": [1_000, 2_000, 3_000],
                           "status": ["ok"] * 3, "device": ["meta"] * 3})
    path = tmp_path / "param_counts.csv"
    counts.to_csv(path, index=False)
    cols = [{"method": m, "architecture": a, "paper": p, "model": {}}
            for m, a, p in (("A", "R18", 990), ("A", "R50", None), ("B", "R18", 3_000))]
    cfg = {"kind": "param_count", "caption": "Table 7", "count": "total", "layout": "grid", "columns": cols}
    out = [tmp_path / "t.md", tmp_path / "t.tex", tmp_path / "t.csv"]
    render_table(cfg, {"counts": str(path)}, *out, {"scale": "mini"})
    md = out[0].read_text(encoding="utf-8")
    assert "| Method | R18 | R50 |" in md
    assert "| A | 1,000 (paper 990; Δ +10) | 2,000 (paper —) |" in md and "| B | 3,000 (paper 3,000; Δ +0) | — |" in md
    assert "frozen ones included" in md and r"\begin{tabular}{lrr}" in out[1].read_text(encoding="utf-8")
