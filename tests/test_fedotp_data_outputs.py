"""FedOTP's data-only outputs (Table A1, Figs. A1, A2) and its config at both scales."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedcore.config import ConfigError, load_config
from fedcore.data.arrays import save_bundle
from fedcore.data.embedded import build_embedded
from fedcore.partition.make import make_partition
from fedcore.report import data_outputs
from fedcore.report.render import render_figure, render_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cfgs():
    return {s: load_config({"scale": s, "seeds": [0], "papers": ["fedotp"]}, ROOT) for s in ("mini", "paper")}


def test_config_has_every_run_group_and_fedotp_is_in_the_default(cfgs):
    import yaml

    assert "fedotp" in yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["papers"]
    paper = cfgs["paper"].experiments
    assert len([e for e in paper if e.startswith("otp_fewshot_")]) == 20  # A4: 4 datasets x 5 shot counts
    assert {paper[f"otp_c100_a{t}"]["partition"]["alpha"] for t in ("0p1", "0p3", "0p5", "1", "5", "10")} == \
        {0.1, 0.3, 0.5, 1.0, 5.0, 10.0}
    a4 = paper["otp_fewshot_dtd_s4"]
    assert (a4["federation"]["rounds"], a4["federation"]["local_epochs"]) == (10, 5)
    assert a4["optimizer"] == {"name": "sgd", "lr": 1e-3, "momentum": 0.9, "weight_decay": 5e-4}
    assert paper["otp_curves_dtd"]["federation"]["rounds"] == 50 and paper["otp_curves_dtd"]["evaluation"]["every"] == 1
    # the curves share A4's 16-shot partition; the bug twins have their own partition files
    assert paper["otp_curves_dtd"]["partition_id"] == paper["otp_fewshot_dtd_s16"]["partition_id"]
    assert paper["otp_office_label_feature_bugs"]["partition_id"] != paper["otp_office_label_feature"]["partition_id"]
    mini = cfgs["mini"].experiments
    assert mini["otp_fewshot_caltech101_s16"]["dataset"] == "digits_five"
    assert mini["otp_c100_coarse"]["dataset"] == "digits"
    assert cfgs["mini"].tables["fedotp_table_a1"]["concrete"]["food101"] is None


def test_bubbles_panels_must_share_a_dataset(tmp_path):
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(ROOT / "config", root / "config")
    rep = root / "config" / "reports" / "fedotp.yaml"
    rep.write_text(rep.read_text().replace("experiment: otp_office_label}", "experiment: otp_domainnet_feature}"))
    with pytest.raises(ConfigError, match="share one dataset"):
        load_config({"scale": "mini", "seeds": [0], "papers": ["fedotp"]}, root)


def test_table_a1_from_bundles(tmp_path):
    save_bundle(build_embedded("digits_styles4"), tmp_path / "digits_styles4.npz")
    cfg = {"kind": "dataset_stats", "caption": "Table A1",
           "rows": [{"dataset": "office_caltech10", "label": "Office-Caltech10", "task": "Image recognition",
                     "paper": {"classes": 10, "train": 2025, "test": 508, "domains": 4}},
                    {"dataset": "food101", "label": "Food101", "paper": {"classes": 101}}],
           "concrete": {"office_caltech10": "digits_styles4", "food101": None}}
    out = {k: tmp_path / f"t.{k}" for k in ("md", "tex", "csv")}
    render_table(cfg, {"datasets": [str(tmp_path / "digits_styles4.npz")]}, out["md"], out["tex"], out["csv"],
                 {"scale": "mini"})
    md = out["md"].read_text()
    assert "| Office-Caltech10 | Image recognition | digits_styles4 | 10 (10) | 942 (2,025) | 315 (508) | 4 (4) |" in md
    assert "| Food101 |  | not configured at this scale | — (101) |" in md
    assert r"\begin{tabular}" in out["tex"].read_text()


def test_figures_a1_a2_render(tmp_path):
    b = build_embedded("digits_styles4")
    save_bundle(b, tmp_path / "digits_styles4.npz")
    paths = []
    for i, spec in enumerate([{"scheme": "domain"}, {"scheme": "domain", "clients_per_domain": 3, "alpha": 0.1}]):
        p = make_partition(spec, 0, b.train.y, b.test.y, b.train.domain, b.test.domain)
        p.save(tmp_path / f"p{i}.npz")
        paths.append(str(tmp_path / f"p{i}.npz"))
    counts = data_outputs.bubble_counts(b.train.y, b.train.domain,
                                        make_partition({"scheme": "domain"}, 0, b.train.y, b.test.y, b.train.domain,
                                                       b.test.domain).train)
    assert counts["count"].sum() == len(b.train) and (counts["client"] == counts["domain"]).all()
    fig = {"kind": "partition_bubbles", "caption": "A2", "panels": [{"label": "a", "experiment": "x"},
                                                                   {"label": "b", "experiment": "y"}]}
    render_figure(fig, {"partition_files": paths, "dataset": str(tmp_path / "digits_styles4.npz")},
                  tmp_path / "a2.png", tmp_path / "a2.pdf", {})
    grid = {"kind": "image_grid", "caption": "A1", "panels": [{"label": "Office", "dataset": "office_caltech10",
                                                              "classes": 3}],
            "concrete": {"office_caltech10": "digits_styles4"}}
    render_figure(grid, {"datasets": [str(tmp_path / "digits_styles4.npz")]}, tmp_path / "a1.png",
                  tmp_path / "a1.pdf", {})
    assert (tmp_path / "a2.png").stat().st_size > 0 and (tmp_path / "a1.pdf").stat().st_size > 0
