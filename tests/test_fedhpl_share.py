"""FedHPL Fig. 3(b) (spec §7.2 J): experiments that keep a share of each client's IID data, and the sweep figure whose
points read their own experiment."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedcore.config import ConfigError, load_config
from fedcore.selection import figure_experiments
from fedcore.partition.make import make_partition
from fedcore.report.fig_metrics import sweep_figure, sweep_points
from fedcore.report.plotting import figure_notes
from fedcore.report.tables import MISSING_RUN, OK

ROOT = Path(__file__).resolve().parents[1]
TOP = {"scale": "mini", "seeds": [0], "papers": ["fedhpl"]}
SHARES = {20: "hpl_c10_iid_homo_p20", 40: "hpl_c10_iid_homo_p40", 60: "hpl_c10_iid_homo_p60",
          80: "hpl_c10_iid_homo_p80", 100: "hpl_c10_iid_homo"}


@pytest.fixture(scope="module")
def cfg():
    return load_config(TOP, ROOT)


@pytest.mark.parametrize("scale", ["mini", "paper"])
def test_share_experiments_are_the_iid_experiment_with_a_kept_fraction(cfg, scale):
    c = cfg.at_scale(scale)
    full = c.experiments["hpl_c10_iid_homo"]
    for pct, name in SHARES.items():
        exp = c.experiments[name]
        assert exp["partition"].get("keep_fraction", 1.0) == pct / 100
        assert {k: v for k, v in exp["partition"].items() if k != "keep_fraction"} == full["partition"]
        assert (exp["dataset"], exp["backbone"]) == (full["dataset"], full["backbone"])
        assert {"fedhpl", "hpl_local"} <= set(exp["methods"])
        for m in ("fedhpl", "hpl_local"):
            assert c.train_params(name, m)["federation"] == c.train_params("hpl_c10_iid_homo", m)["federation"]
    assert len({c.experiments[n]["partition_id"] for n in SHARES.values()}) == 5


def test_the_shares_are_nested_subsets_of_the_full_iid_partition(cfg):
    """On labels with the mini dataset's size: the 20 % clients hold a subset of the 40 % ones', ..., of the full."""
    y = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 94))
    parts = {pct: make_partition(cfg.experiments[n]["partition"], 0, y, y[:300]) for pct, n in SHARES.items()}
    for small, large in zip((20, 40, 60, 80), (40, 60, 80, 100)):
        for s, g in zip(parts[small].train, parts[large].train, strict=True):
            assert np.isin(s, g).all()
            assert len(s) == pytest.approx(small / large * len(g), abs=10)  # ±1 per class after rounding


def _rows(exp: str, method: str, accs: list[float]) -> list[dict]:
    """Final-round accuracies of one run's clients on the global test set: mean, lowest, highest (as logged)."""
    base = {"paper": "fedhpl", "experiment": exp, "method": method, "scale": "mini", "dataset": "digits", "seed": 0,
            "round": 10, "split": "global", "client": -1}
    return [{**base, "metric": m, "value": float(f(accs))} for m, f in (("acc", np.mean), ("acc_min", min),
                                                                         ("acc_max", max))]


def test_fig3b_draws_each_share_from_its_own_experiment(cfg):
    fig_cfg = cfg.figures["fedhpl_fig3b"]
    assert figure_experiments(fig_cfg) == ["hpl_c10_iid_homo", *[SHARES[p] for p in (20, 40, 60, 80)]]
    rows = []
    for pct, exp in SHARES.items():
        rows += _rows(exp, "fedhpl", [0.5 + pct / 400 + 0.01 * k for k in range(5)])
        if pct != 60:
            rows += _rows(exp, "hpl_local", [0.4 + pct / 400 + 0.02 * k for k in range(5)])
    metrics, view, impl = pd.DataFrame(rows), cfg.report_view(), set(cfg.implemented_methods())
    pts = sweep_points(metrics, fig_cfg, view, "mini", impl)
    fed_avg = pts.loc[pts["series"] == 0]      # "FedHPL, average"
    assert fed_avg["value"].tolist() == [20, 40, 60, 80, 100]
    np.testing.assert_allclose(fed_avg["y"], [100 * (0.52 + p / 400) for p in (20, 40, 60, 80, 100)])
    local_low = pts.loc[pts["series"] == 4]    # "Local, lowest"
    np.testing.assert_allclose(local_low["y"].dropna(), [100 * (0.4 + p / 400) for p in (20, 40, 80, 100)])
    assert local_low["status"].tolist() == [OK, OK, MISSING_RUN, OK, OK]
    fig = sweep_figure(metrics, fig_cfg, view, "mini", impl)
    assert "Local, average at 60 (Local) (missing run)" in figure_notes(fig)


def test_a_sweep_point_naming_an_unknown_experiment_is_refused(tmp_path):
    import shutil

    import yaml

    shutil.copytree(ROOT / "config", tmp_path / "config")
    path = tmp_path / "config" / "reports" / "fedhpl.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["figures"]["fedhpl_fig3b"]["series"][1]["points"][0]["experiment"] = "hpl_c10_iid_homo_p10"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"fedhpl_fig3b\) at series\[1\].points\[0\].experiment: "
                                          r"'hpl_c10_iid_homo_p10' is not one of"):
        load_config(TOP, tmp_path)
