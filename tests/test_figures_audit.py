"""The paper figures checked against the papers (figure audit): series and lines the paper's figure has, legends
that cover no data, and the scale note every figure carries."""
from __future__ import annotations

from pathlib import Path

import pytest

from fedcore.config import load_config
from fedcore.selection import figure_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["mini", "paper"])
def fedhpl(request):
    return load_config({"scale": request.param, "seeds": [0], "papers": ["fedhpl"]}, ROOT)


@pytest.mark.parametrize("name", ["fedhpl_fig3a", "fedhpl_fig12_gamma", "fedhpl_fig12_temperature"])
def test_fedhpl_sweeps_draw_lowest_average_and_highest_for_deep_and_shallow(fedhpl, name):
    """FedHPL Figs. 3(a)/11 and 12 show the lowest, average and highest client for VPT-deep and VPT-shallow
    (paper: Fig. 11's caption, §C.5.5 "We compare ... the lowest, average, and highest accuracy")."""
    fig = fedhpl.figures[name]
    metric = {"average": "global_acc", "lowest": "global_acc_min", "highest": "global_acc_max"}
    series = {s["label"]: s for s in fig["series"]}
    for insertion in ("deep", "shallow"):
        for which, m in metric.items():
            label = f"{insertion}, {which}"
            assert label in series, f"{name} lacks the series {label!r}"
            assert series[label]["metric"] == m
    # a variant's three series read the same runs
    for insertion in ("deep", "shallow"):
        runs = {tuple(sorted((p["value"], p["method"]) for p in series[f"{insertion}, {w}"]["points"]))
                for w in metric}
        assert len(runs) == 1, f"{name}: the {insertion} series read different runs"


def test_fedhpl_fig6_has_fedhpl_cnn_and_vit_lines(fedhpl):
    """FedHPL Fig. 6: "FedHPLc and FedHPLv represent FedHPL (CNN) and FedHPL (ViT) in Table 2": both are lines,
    the ViT one read from the heterogeneous-ViT experiment of each panel's data setting, as Table 2's row."""
    fig = fedhpl.figures["fedhpl_fig6"]
    runs = figure_runs(fig, fedhpl.experiments)
    for panel in fig["panels"]:
        exp = panel["experiment"]
        assert (exp, "fedhpl") in runs
        assert (exp.replace("_hetres", "_hetvit"), "fedhpl") in runs
        for m in ("fedgen", "fedgh", "fedproto", "fedtgp", "fedmd", "fedhe"):
            assert (exp, m) in runs
    table2 = fedhpl.tables["fedhpl_table2"]
    assert fig["lines"][-1]["experiment_replace"] == table2["row_sources"]["hpl_vit"]["experiment_replace"]


# ----------------------------------------------------------------------------------------------
# Legends never cover data (per-class lines, grouped bars)
# ----------------------------------------------------------------------------------------------

def _frame(rows):
    import pandas as pd

    df = pd.DataFrame(rows, columns=["experiment", "method", "seed", "round", "client", "split", "metric", "value"])
    df.insert(0, "paper", "fedhpl")
    df.insert(3, "scale", "mini")
    return df.astype({"seed": "int64", "round": "int64", "client": "int64", "value": "float64"})


def _exp(methods):
    return {"methods": methods, "report": {"window": "last", "rounds": 1}, "paper": "fedhpl", "rounds": 2}


def _legend_boxes(fig):
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return [lg.get_window_extent(r) for lg in legends], [ax.get_window_extent(r) for ax in fig.axes if ax.get_visible()]


def test_per_class_legend_sits_outside_every_panel():
    """Eight methods' legend inside the first panel covered its curves (lower left, where low accuracies lie)."""
    from fedcore.report.fig_metrics import per_class_figure

    methods = [f"m{i}" for i in range(8)]
    panels = [{"label": f"P{k}", "experiment": f"e{k}"} for k in range(3)]
    rows = [(p["experiment"], m, 0, 2, -1, "global", f"acc_class{c}", 0.1 + 0.02 * c)
            for p in panels for m in methods for c in range(10)]
    fig = per_class_figure(_frame(rows), {"kind": "per_class", "caption": "c", "methods": methods, "panels": panels},
                           {p["experiment"]: _exp(methods) for p in panels}, "mini", set(methods))
    legends, panels_px = _legend_boxes(fig)
    assert len(legends) == 1
    assert not any(legends[0].overlaps(ax) for ax in panels_px)


def test_bars_legend_sits_outside_the_axes():
    """Grouped bars (FedHPL Figs. 3(c), 7-9): matplotlib's 'best' spot inside the axes covered the tallest bars."""
    from fedcore.report.fig_metrics import bars_figure

    rows_ = ["a", "b", "c", "d"]
    cols = [{"label": k, "experiment": f"e{k}", "metric": "global_acc"} for k in ("IID", "Dir", "Non-IID")]
    rows = [(c["experiment"], m, 0, 2, -1, "global", "acc", 0.9) for c in cols for m in rows_]
    fig = bars_figure(_frame(rows), {"kind": "bars", "caption": "c", "rows": rows_, "columns": cols},
                      {c["experiment"]: _exp(rows_) for c in cols}, "mini", set(rows_))
    legends, panels_px = _legend_boxes(fig)
    assert len(legends) == 1
    assert not any(legends[0].overlaps(ax) for ax in panels_px)


# ----------------------------------------------------------------------------------------------
# The scale note in every figure's caption
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale, note", [("mini", "[scale mini: embedded analogue data and tiny backbones, not the "
                                                  "paper's results]"),
                                         ("smoke", "[scale smoke: synthetic data, not results]"),
                                         ("paper", "[scale paper]")])
def test_rendered_figure_caption_ends_with_the_scale_note(tmp_path, monkeypatch, scale, note):
    """A mini figure said only "[scale mini]": nothing told a reader of the PNG alone that its numbers are not the
    paper's (every table says so in its scale note)."""
    from fedcore.report import render
    from fedcore.report.plotting import figure_notes, new_figure, set_caption

    seen = {}

    def fake_build(fig_cfg, path, context):
        fig, _ = new_figure(1, 1)
        set_caption(fig, fig_cfg["caption"])
        seen["fig"] = fig
        return fig

    monkeypatch.setattr(render, "build_figure", fake_build)
    render.render_figure({"kind": "sweep", "caption": "Fig. X."}, {"metrics": "unused"}, tmp_path / "f.png",
                         tmp_path / "f.pdf", {"scale": scale})
    text = figure_notes(seen["fig"])
    assert f"Fig. X. {note}" in text


# ----------------------------------------------------------------------------------------------
# Accuracy per round (SGPT's curves, FedOTP Fig. A3, FedPFT Fig. 5(a)/(c)): a listed method without a curve is named
# ----------------------------------------------------------------------------------------------

def test_accuracy_per_round_names_listed_methods_without_a_curve():
    """FedOTP Fig. A3 lists CoOp, PromptFL, PromptFL+FedProx and FedOTP: a missing or unconfigured one vanished from
    its panel without a word unless the whole panel was empty."""
    import pandas as pd

    from fedcore.report.figures import make_figure
    from fedcore.report.plotting import figure_notes

    rows = [("e1", m, 0, r, -1, "local", "acc_mean", 0.5) for m in ("coop", "fedotp") for r in (1, 2)]
    rows += [("e1", "promptfl", 0, r, -1, "global", "acc", 0.5) for r in (1, 2)]   # a run without the metric
    metrics = _frame(rows)
    metrics["dataset"] = "d"
    cfg = {"kind": "accuracy_per_round", "caption": "A3", "experiments": ["e1"], "metric": "local_acc",
           "methods": ["coop", "promptfl", "promptfl_fedprox", "fedotp", "newcomer"],
           "labels": {"promptfl_fedprox": "PromptFL+FedProx"}}
    exps = {"e1": _exp(["coop", "promptfl", "promptfl_fedprox", "fedotp"])}
    fig = make_figure(metrics, cfg, scale="mini", experiments=exps,
                      implemented={"coop", "promptfl", "promptfl_fedprox", "fedotp"})
    assert len(fig.axes[0].get_lines()) == 2
    notes = figure_notes(fig)
    assert "Not drawn: e1: promptfl (missing metric); e1: PromptFL+FedProx (missing run); " \
           "e1: newcomer (not implemented)" in notes
    # without experiment dicts (the tests' and plot_accuracy_per_round's default), runs and metrics still told apart
    notes = figure_notes(make_figure(metrics, cfg))
    assert "e1: PromptFL+FedProx (missing run)" in notes and "e1: promptfl (missing metric)" in notes
    assert "coop (" not in notes and "fedotp (" not in notes


def test_bars_legend_colours_match_the_bars_when_a_row_has_none():
    """A row without any number still got a legend entry, drawn in the default colour (another row's): FedHPL
    Fig. 8 at mini showed four identical blue swatches."""
    from matplotlib.colors import to_rgba

    from fedcore.report.fig_metrics import bars_figure

    rows_ = ["a", "b", "c"]
    cols = [{"label": k, "experiment": f"e{k}", "metric": "global_acc"} for k in ("IID", "Dir")]
    rows = [(c["experiment"], m, 0, 2, -1, "global", "acc", 0.9) for c in cols for m in ("a", "c")]
    fig = bars_figure(_frame(rows), {"kind": "bars", "caption": "c", "rows": rows_, "columns": cols},
                      {c["experiment"]: _exp(rows_) for c in cols}, "mini", set(rows_))
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["a", "c"]
    assert [h.get_facecolor() for h in legend.legend_handles] == [to_rgba("C0"), to_rgba("C2")]
    assert "Dir: b (missing run)" in " ".join(t.get_text() for t in fig.texts)


def test_sweep_selects_the_baselines_it_draws():
    """SGPT Fig. 6b draws the best baseline of each metric as a line: built alone (`outputs=[sgpt_fig6b]`), its
    baseline runs were not selected, so the lines were never drawn."""
    cfg = load_config({"scale": "mini", "seeds": [0], "papers": ["sgpt"], "outputs": ["sgpt_fig6b"]}, ROOT)
    fig = cfg.figures["sgpt_fig6b"]
    assert fig["baselines"]
    for m in fig["baselines"]:
        assert cfg.is_selected(fig["experiment"], m), m


def test_empty_sweep_and_bars_keep_their_setting_labels():
    """With no run at all, the grey × of each missing setting or column stood on an axis without labels."""
    from fedcore.report.fig_metrics import bars_figure, sweep_figure

    exps = {"e": _exp(["a", "b"])}
    empty = _frame([("e", "z", 0, 2, -1, "global", "acc", 0.5)])
    cols = [{"label": k, "experiment": "e", "metric": "global_acc"} for k in ("IID", "Dir")]
    fig = bars_figure(empty, {"kind": "bars", "caption": "c", "rows": ["a", "b"], "columns": cols}, exps, "mini",
                      {"a", "b"})
    fig.canvas.draw()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels() if t.get_visible()] == ["IID", "Dir"]
    sweep = {"kind": "sweep", "caption": "c", "experiment": "e", "param_label": "n",
             "series": [{"label": "s", "metric": "global_acc", "points": [{"value": 1, "method": "a"},
                                                                         {"value": 3, "method": "b"}]}]}
    fig = sweep_figure(empty, sweep, exps, "mini", {"a", "b"})
    fig.canvas.draw()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels() if t.get_visible()] == ["1", "3"]


# ----------------------------------------------------------------------------------------------
# A drawn number carries its table cell's marks (‡ a run ended early, † a short window, ...), explained below
# ----------------------------------------------------------------------------------------------

def _marked_texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts if t.get_text() in ("†", "‡", "†‡")]


def test_bars_and_sweeps_mark_a_run_that_ended_early_as_its_table_cell_does():
    """A run whose last round is before the experiment's configured rounds is marked ‡ in its table cell; its bar
    and its sweep point were drawn like any other (figure audit: "tables mark ‡ and †, figures do not")."""
    from fedcore.report.fig_metrics import bars_figure, sweep_figure
    from fedcore.report.plotting import figure_notes

    rows_ = ["a", "b"]
    cols = [{"label": "IID", "experiment": "e1", "metric": "global_acc"}]
    rows = [("e1", "a", 0, 2, -1, "global", "acc", 0.9), ("e1", "b", 0, 1, -1, "global", "acc", 0.5)]
    exps = {"e1": _exp(rows_)}
    fig = bars_figure(_frame(rows), {"kind": "bars", "caption": "c", "rows": rows_, "columns": cols}, exps, "mini",
                      set(rows_))
    assert _marked_texts(fig) == ["‡"]
    assert "‡ a run ended before the experiment's configured number of rounds." in figure_notes(fig)
    sweep = {"kind": "sweep", "caption": "c", "experiment": "e1", "param_label": "n",
             "series": [{"label": "s", "metric": "global_acc", "points": [{"value": 1, "method": "a"},
                                                                            {"value": 2, "method": "b"}]}]}
    fig = sweep_figure(_frame(rows), sweep, exps, "mini", set(rows_))
    assert _marked_texts(fig) == ["‡"]
    assert "‡ a run ended" in figure_notes(fig)
    complete = [("e1", "b", 0, 2, -1, "global", "acc", 0.5) if r[1] == "b" else r for r in rows]
    fig = sweep_figure(_frame(complete), sweep, exps, "mini", set(rows_))
    assert _marked_texts(fig) == [] and "‡" not in figure_notes(fig)


def test_the_scatter_labels_a_point_with_its_marks():
    """SGPT Fig. 1's points: a method whose run ended early is labelled with ‡, as its table cell."""
    from fedcore.report.fig_metrics import scatter_figure
    from fedcore.report.plotting import figure_notes

    rows = [("e1", m, 0, r, -1, "global", metric, v + d) for m, r, d in (("a", 2, 0.0), ("b", 1, 0.1))
            for metric, v in (("acc", 0.8), ("acc_min", 0.5))]
    cfg = {"kind": "scatter", "caption": "c", "experiment": "e1", "methods": ["a", "b"], "x_metric": "global_acc",
           "y_metric": "global_acc_min"}
    fig = scatter_figure(_frame(rows), cfg, {"e1": _exp(["a", "b"])}, "mini", {"a", "b"})
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "b‡" in labels and "a" in labels
    assert "‡ a run ended" in figure_notes(fig)
