"""FedHPL with self-supervised backbones (Tables 12, 13): each run is paired with its supervised twin's partition,
the paper's budget and backbones at paper scale, the cheap analogue at mini."""
from __future__ import annotations

from pathlib import Path

import pytest

from fedcore.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DATASETS, SETTINGS, MODELS = ("c10", "c100", "svhn"), ("iid", "dir", "noniid", "a0p1", "a0p5", "a1p0"), ("homo", "hetvit")
MOCO = [f"hpl_moco_{d}_{s}_{m}" for d in DATASETS for s in SETTINGS for m in MODELS]


@pytest.fixture(scope="module")
def mini():
    return load_config({"scale": "mini", "seeds": [0], "papers": ["fedhpl"]}, ROOT)


@pytest.mark.parametrize("scale", ["mini", "paper"])
def test_each_moco_run_reads_its_supervised_twins_partition(mini, scale) -> None:
    cfg = mini.at_scale(scale)
    assert sorted(e for e in cfg.experiments if e.startswith("hpl_moco_")) == sorted(MOCO)
    for name in MOCO:
        moco, twin = cfg.experiments[name], cfg.experiments[name.replace("hpl_moco_", "hpl_")]
        # the partition file is results/partitions/<dataset>/<partition_id>/seed<s>.npz: one artifact for both
        assert (moco["dataset"], moco["partition_id"]) == (twin["dataset"], twin["partition_id"]), name
        assert moco["partition"] == twin["partition"] and moco["evaluation"] == twin["evaluation"], name
        assert moco["optimizer"] == twin["optimizer"], name


def test_paper_scale_runs_the_papers_budget_on_ssl_backbones(mini) -> None:
    paper = mini.at_scale("paper")
    runs = [r for r in paper.runs() if r["experiment"].startswith("hpl_moco_")]
    assert sorted(r["experiment"] for r in runs) == sorted(MOCO) and {r["method"] for r in runs} == {"fedhpl"}
    for name in MOCO:
        fed = paper.train_params(name, "fedhpl")["federation"]
        assert (fed["rounds"], fed["local_epochs"], fed["batch_size"]) == (50, 1, 16), name
    assert paper.experiments["hpl_moco_c10_iid_homo"]["backbone"] == "vit_b16_mocov3"
    assert paper.experiments["hpl_moco_c100_a0p1_hetvit"]["client_backbones"] == [
        "vit_s16_mocov3", "vit_b16_mocov3", "vit_l16_mae", "vit_b16_mocov3", "vit_s16_mocov3"]
    assert paper.backbones["vit_l16_mae"]["tag"] == "mae"  # MAE stands in for the missing MoCo v3 ViT-L


def test_mini_runs_the_cifar10_analogue_only(mini) -> None:
    runs = {r["experiment"] for r in mini.runs() if r["experiment"].startswith("hpl_moco_")}
    assert runs == {n for n in MOCO if "_c10_" in n}
    for name in runs:
        assert mini.train_params(name, "fedhpl")["federation"]["rounds"] == 20
        # "MoCo-v3 (1)" is read at the supervised twin's last round: it must be an evaluated round of this run
        twin_rounds = mini.train_params(name.replace("hpl_moco_", "hpl_"), "fedhpl")["federation"]["rounds"]
        assert twin_rounds == 10 and twin_rounds % mini.experiments[name]["evaluation"]["every"] == 0
    assert mini.experiments["hpl_moco_c10_a0p1_hetvit"]["client_backbones"] == [
        "vit_mini_s_moco", "vit_mini_moco", "vit_mini_l_moco", "vit_mini_moco", "vit_mini_s_moco"]


def _acc_rows(experiment: str, rounds: int, value_at) -> list[dict]:
    return [{"paper": "fedhpl", "experiment": experiment, "method": "fedhpl", "scale": "mini", "dataset": "digits",
             "seed": 0, "round": r, "client": -1, "split": "global", "metric": "acc", "value": value_at(r)}
            for r in range(5, rounds + 1, 5)]


def test_table13_reads_the_ssl_run_at_the_supervised_budget_and_at_its_end(mini) -> None:
    import pandas as pd

    from fedcore.report.tables import build_table

    rows = (_acc_rows("hpl_moco_c10_a0p5_homo", 20, lambda r: r / 100)        # 0.05, 0.10, 0.15, 0.20
            + _acc_rows("hpl_c10_a0p5_homo", 10, lambda r: 0.9 + r / 1000))  # supervised: final 0.91
    out = build_table(pd.DataFrame(rows), mini.tables["fedhpl_table13"], mini.report_view(), "mini",
                      set(mini.implemented_methods()))
    cell = out[out.row == "t13_a0p5"].set_index("column")
    assert cell.loc["C10 Homog MoCo-v3 (1)", "ours"] == pytest.approx(10.0)     # round 10 of the 20-round run
    assert cell.loc["C10 Homog MoCo-v3 (2)", "ours"] == pytest.approx(20.0)     # its final round
    assert cell.loc["C10 Homog Supervised", "ours"] == pytest.approx(91.0)
    assert cell.loc["C10 Homog MoCo-v3 (1)", "experiment"] == "hpl_moco_c10_a0p5_homo"
    assert cell.loc["C10 Hetero MoCo-v3 (2)", "status"] == "missing run"
    assert cell.loc["C100 Homog MoCo-v3 (1)", "status"] == "not configured"     # mini: the CIFAR-10 analogue only
    paper = mini.at_scale("paper")
    col = {c["label"]: c for c in paper.tables["fedhpl_table13"]["columns"]}
    assert col["C100 Hetero MoCo-v3 (1)"]["round"] == col["SVHN Homog MoCo-v3 (1)"]["round"] == 15
    for label, c in col.items():  # (1) = the supervised twin's budget at paper scale
        if label.endswith("(1)"):
            twin = c["experiment"].replace("hpl_moco_", "hpl_")
            assert c["round"] == paper.train_params(twin, "fedhpl")["federation"]["rounds"], label


@pytest.mark.parametrize("scale", ["mini", "paper"])
def test_a_runs_clients_share_one_input_contract(mini, scale) -> None:
    """train_run feeds every client one input: MoCo v3's ViT-S/B and MAE's ViT-L all expect ImageNet's mean/std."""
    from fedcore.backbones.registry import input_cfg
    from fedcore.config import run_backbones

    cfg = mini.at_scale(scale)
    for name in MOCO:
        contracts = {tuple(input_cfg(cfg.backbones[b]["arch"], cfg.backbones[b].get("tag")).items())
                     for b in run_backbones(cfg.experiments[name])}
        assert len(contracts) == 1, name
