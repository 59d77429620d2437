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
        assert twin_rounds == 10 and mini.experiments[name]["evaluation"]["every"] == 1
    assert mini.experiments["hpl_moco_c10_a0p1_hetvit"]["client_backbones"] == [
        "vit_mini_s_moco", "vit_mini_moco", "vit_mini_l_moco", "vit_mini_moco", "vit_mini_s_moco"]
