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
