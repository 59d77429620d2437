"""Scale smoke (config/scales/smoke.yaml over the paper scale): the paper scale's runs on synthetic data, one round.

Checked without Snakemake: the run list equals the paper scale's, each run keeps the paper's setup but for the listed
smoke changes, every synthetic analogue has its paper dataset's facts and every smoke partition gives every client
data, random stand-ins replace missing weight files at smoke only, and every table and figure says "smoke: synthetic
data, not results". tests/test_smoke_runs.py runs one smoke run per paper on the CPU.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from fedcore.backbones import registry
from fedcore.backbones.registry import ArchSpec, PretrainedCfg, build_backbone
from fedcore.backbones.standin import save_random_weights, standin_note
from fedcore.config import ConfigError, load_config
from fedcore.data.arrays import load_bundle
from fedcore.data.facts import FACTS, SYNTHETIC, SyntheticSize, dataset_facts
from fedcore.data.registry import build_dataset, check_data, is_generated, raw_files
from fedcore.data.synthetic import build_synthetic, synthetic_labels
from fedcore.partition.make import class_counts, make_partition
from fedcore.report.plotting import figure_notes
from fedcore.train import weight_records

ROOT = Path(__file__).resolve().parents[1]
BANNER = "SMOKE: SYNTHETIC DATA, NOT RESULTS"

# What the smoke scale may change in a run's params besides its dataset (the synthetic analogue) and its rounds
# (config/scales/smoke.yaml and smoke/<paper>.yaml): FedPFT's per-client sample counts, FedMD's public data and
# transfer epochs, FedPFT's two-stage switch and MoCo queue.
SMOKE_PARTITION_KEYS = {"train_per_client", "test_per_client", "train_per_class", "test_per_class"}
SMOKE_METHOD_KEYS = {"public", "public_subset", "pretrain_epochs", "two_stage", "queue_size"}
SAME_KEYS = ("backbone", "client_backbones", "input_size", "augment", "optimizer", "evaluation", "method", "paper")


@pytest.fixture
def smoke(smoke_config):
    """Every paper at scale smoke, every output (the whole DAG; conftest.py)."""
    return smoke_config


def _runs(cfg) -> list[tuple]:
    return sorted((r["experiment"], r["method"], r["seed"]) for r in cfg.runs())


def _changed(a: dict, b: dict) -> set[str]:
    """The keys whose values differ between two mappings (present in one only included)."""
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def test_smoke_lists_every_paper_scale_training_run(smoke):
    paper = smoke.at_scale("paper")
    assert paper.runs() and _runs(smoke) == _runs(paper)


def test_smoke_runs_keep_the_papers_setup_on_synthetic_data(smoke):
    paper = smoke.at_scale("paper")
    for r in paper.runs():
        e, m = r["experiment"], r["method"]
        s, p = smoke.train_params(e, m), paper.train_params(e, m)
        where = f"{e}/{m}"
        for key in SAME_KEYS:
            assert s.get(key) == p.get(key), f"{where}: {key}"
        assert SYNTHETIC[s["dataset"]].like == p["dataset"], where
        assert {k: v for k, v in s["federation"].items() if k != "rounds"} == \
            {k: v for k, v in p["federation"].items() if k != "rounds"}, where
        two_stage = s["method_params"].get("two_stage")
        assert s["federation"]["rounds"] == (2 if two_stage else 1), where
        assert s["partition"]["scheme"] == p["partition"]["scheme"], where
        assert _changed(s["partition"], p["partition"]) <= SMOKE_PARTITION_KEYS, where
        assert _changed(s["method_params"], p["method_params"]) <= SMOKE_METHOD_KEYS, where


def test_smoke_budgets_override_the_methods_own(smoke):
    paper = smoke.at_scale("paper")
    assert paper.federation("hpl_c10_iid_homo", "fedavg")["rounds"] > 1   # FedHPL's baselines: their own 100 rounds
    assert smoke.federation("hpl_c10_iid_homo", "fedavg")["rounds"] == 1
    assert smoke.federation("pft_c100_dir0p1", "pft_two_stage")["rounds"] == 2   # one round per stage
    assert smoke.method_params("pft_c100_dir0p1", "pft_two_stage")["two_stage"] == 1


def test_smoke_reads_only_synthetic_analogues_of_the_paper_datasets(smoke):
    for name in smoke.datasets():
        assert name in SYNTHETIC and is_generated(name) and raw_files(name, {"files": []}) == []
        ours, theirs = dataset_facts(name), dataset_facts(SYNTHETIC[name].like)
        for key in ("classes", "domains", "coarse", "image_size", "channels"):
            assert getattr(ours, key) == getattr(theirs, key), (name, key)


def test_smoke_jobs_share_the_gpu_and_keep_no_run_state(smoke):
    r = smoke.runs()[0]
    assert smoke.run_resources(r["experiment"], r["method"])["gpu"] == 0 and not smoke.keep_run_state
    paper = smoke.at_scale("paper")
    assert paper.run_resources(r["experiment"], r["method"])["gpu"] == 1 and paper.keep_run_state


def test_claim_checks_of_other_scales_leave_smoke_out(smoke):
    assert "smoke" in smoke.claims_view("sgpt")   # its own claim check runs (the machinery), on its own tables
    mini = load_config({"scale": "mini", "seeds": [0], "papers": ["sgpt"], "outputs": "all"}, ROOT)
    assert sorted(mini.claims_view("sgpt")) == ["mini", "paper"]


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_synthetic_analogue_has_its_datasets_facts(name):
    size, facts = SYNTHETIC[name], dataset_facts(name)
    like = FACTS[size.like]
    for split, labels in synthetic_labels(name).items():  # the registered size, labels only
        f = getattr(facts, split)
        assert (f.size, f.min_class) == (len(labels["y"]), np.bincount(labels["y"]).min())
        assert f.min_domain == (None if labels["domain"] is None else np.bincount(labels["domain"]).min())
        assert (labels["coarse"] is None) == (like.coarse == 0)
        assert set(np.unique(labels["y"])) == set(range(like.classes))
    small = SyntheticSize(size.like, 1, 1)  # images at one per class (and domain): the shape, cheaply
    bundle = build_synthetic(name, small)
    assert bundle.train.x.shape[1:] == (like.image_size,) * 2 + (3,) and bundle.num_classes == like.classes
    assert len(bundle.meta.get("domains", [])) == like.domains and bundle.meta["synthetic"] is True
    if like.channels == 1:  # a grey source: the three channels are equal
        assert (bundle.train.x[..., 0] == bundle.train.x[..., 2]).all()
    again = build_synthetic(name, small)
    assert np.array_equal(again.train.x, bundle.train.x) and np.array_equal(again.test.y, bundle.test.y)
    labels = synthetic_labels(name, small)
    assert np.array_equal(labels["train"]["y"], bundle.train.y)


def test_smoke_partitions_give_every_client_data(smoke):
    labels = {}
    for (dataset, pid), spec in smoke.partitions(run_only=True).items():
        lab = labels.setdefault(dataset, synthetic_labels(dataset))
        part = make_partition(spec, smoke.seeds[0], lab["train"]["y"], lab["test"]["y"], lab["train"]["domain"],
                              lab["test"]["domain"], lab["train"]["coarse"], lab["test"]["coarse"])
        assert min(len(t) for t in part.train) > 0, f"{dataset}/{pid}: a client without train data"
        assert min(len(t) for t in part.test) > 0, f"{dataset}/{pid}: a client without test data"


def test_build_dataset_generates_a_synthetic_analogue_without_raw_files(tmp_path):
    build_dataset("smoke_five_dataset", tmp_path / "five.npz")
    bundle = load_bundle(tmp_path / "five.npz")
    assert bundle.meta["name"] == "smoke_five_dataset" and bundle.meta["like"] == "five_dataset"
    assert len(bundle.train) == dataset_facts("smoke_five_dataset").train.size
    assert check_data(["smoke_five_dataset"], tmp_path, {"files": []}) == []


# ---- the scale files -----------------------------------------------------------------------------------------
def _config_copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "config", tmp_path / "config")
    return tmp_path


def _edit(path: Path, edit) -> None:
    doc = yaml.safe_load(path.read_text()) if path.exists() else {}
    edit(doc)
    path.write_text(yaml.safe_dump(doc))


def test_smoke_files_merge_over_the_paper_scales_in_order(tmp_path):
    root = _config_copy(tmp_path)
    scales = root / "config" / "scales"
    _edit(scales / "paper" / "sgpt.yaml", lambda d: d.update(evaluation={"every": 7, "batch_size": 9}))
    _edit(scales / "smoke.yaml", lambda d: d.update(evaluation={"every": 3}))
    _edit(scales / "smoke" / "sgpt.yaml",
          lambda d: d.setdefault("experiments", {}).update(sgpt_five={"evaluation": {"every": 2}}))
    cfg = load_config({"scale": "smoke", "seeds": [0], "papers": ["sgpt"]}, root)
    # paper.yaml < paper/sgpt.yaml < smoke.yaml < smoke/sgpt.yaml
    assert cfg.experiments["sgpt_office"]["evaluation"] == {"global_test": "pooled_local", "every": 3, "batch_size": 9}
    assert cfg.experiments["sgpt_five"]["evaluation"]["every"] == 2
    assert cfg.at_scale("paper").experiments["sgpt_office"]["evaluation"]["every"] == 7


@pytest.mark.parametrize("file, base, needle", [
    ("smoke.yaml", "huge", "config/scales/smoke.yaml at base: 'huge' is not a scale"),
    ("paper.yaml", "smoke", "at base: 'smoke' starts a cycle of scales (smoke -> paper -> smoke)"),
])
def test_a_bad_base_scale_is_named(tmp_path, file, base, needle):
    root = _config_copy(tmp_path)
    _edit(root / "config" / "scales" / file, lambda d: d.update(base=base))
    with pytest.raises(ConfigError, match="base") as e:
        load_config({"scale": "smoke", "seeds": [0], "papers": ["sgpt"]}, root)
    assert needle in str(e.value)


# ---- random stand-ins for missing weight files ---------------------------------------------------------------
def test_a_missing_weight_file_is_replaced_at_smoke_only(tmp_path):
    top = {"scale": "smoke", "seeds": [0], "papers": ["sgpt"], "resources": str(tmp_path / "res")}
    smoke = load_config(top, ROOT)
    paper, mini = smoke.at_scale("paper"), smoke.at_scale("mini")
    assert smoke.uses_standin("vit_b16_in21k") and not paper.uses_standin("vit_b16_in21k")
    assert not smoke.uses_standin("resnet8_pft") and not mini.uses_standin("vit_mini")  # scratch, pretrained
    weights = tmp_path / "res" / "weights" / smoke.backbones["vit_b16_in21k"]["weights"]
    weights.parent.mkdir(parents=True)
    weights.touch()  # a file the user placed is read, at every scale
    assert not smoke.uses_standin("vit_b16_in21k")


def test_standin_loads_through_the_weight_file_path_and_is_fixed(tmp_path):
    torch.manual_seed(5)
    before = torch.rand(1)
    path = tmp_path / "r18.safetensors"
    save_random_weights("resnet18", "tv_in1k", path, replaces="resources/weights/resnet18.tv_in1k.safetensors")
    model = build_backbone("resnet18", path, "tv_in1k")   # torchvision's strict load, as a real file
    save_random_weights("resnet18", "tv_in1k", tmp_path / "again.safetensors")
    again = build_backbone("resnet18", tmp_path / "again.safetensors", "tv_in1k")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), before)  # the caller's random stream is left alone
    note = standin_note(path)
    assert note["arch"] == "resnet18" and note["replaces"].endswith("resnet18.tv_in1k.safetensors")


def test_standin_is_written_in_its_tags_file_layout(tmp_path, monkeypatch):
    spec = registry.ARCH_SPECS["vit_mini_s"]
    monkeypatch.setitem(registry.ARCH_SPECS, "vit_tiny_moco", ArchSpec(**{**spec.__dict__, "default_tag": "moco"}))
    monkeypatch.setitem(registry.PRETRAINED_CFGS, "vit_tiny_moco.moco",
                        PretrainedCfg(16, (0.5,) * 3, (0.5,) * 3, layout="mocov3"))
    path = tmp_path / "moco.safetensors"
    save_random_weights("vit_tiny_moco", "moco", path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert all(k.startswith("base_encoder.") for k in f.keys())
    build_backbone("vit_tiny_moco", path, "moco")   # converted back by the MoCo v3 loader, strictly


def test_a_run_logs_and_records_its_standin(tmp_path, caplog):
    path = tmp_path / "r18.safetensors"
    save_random_weights("resnet18", None, path, replaces="resources/weights/x.safetensors")
    with caplog.at_level(logging.INFO, logger="fedcore.train"):
        records = weight_records(["resnet18", "resnet8_pft"], [path, None])
    assert records[0]["random_standin"]["replaces"] == "resources/weights/x.safetensors"
    assert records[1] == {"arch": "resnet8_pft", "weights": None, "random_standin": None}
    assert "RANDOM stand-in weights" in caplog.text and "not a result" in caplog.text


# ---- the banner on every table and figure ------------------------------------------------------------------
def test_smoke_tables_and_figures_say_they_are_not_results(tmp_path, monkeypatch):
    from fedcore.report import plotting, render

    counts = pd.DataFrame({"column": [0], "source": ["torchvision"], "arch": ["resnet18"], "method": [""],
                           "experiment": [""], "num_classes": [10], "trainable": [11], "total": [11],
                           "status": ["ok"], "device": ["meta"]})
    counts.to_csv(tmp_path / "counts.csv", index=False)
    cfg = {"kind": "param_count", "caption": "Table 5",
           "columns": [{"method": "FedAvg", "architecture": "ResNet-18", "paper": 11, "model": {}}]}
    for scale in ("smoke", "mini"):
        out = [tmp_path / f"{scale}.{ext}" for ext in ("md", "tex", "csv")]
        render.render_table(cfg, {"counts": str(tmp_path / "counts.csv")}, *out, {"scale": scale},
                            out_html=tmp_path / f"{scale}.html")
        for path in (out[0], out[1], tmp_path / f"{scale}.html"):
            assert (BANNER in path.read_text(encoding="utf-8")) == (scale == "smoke"), path
    lab = synthetic_labels("smoke_cifar10", SyntheticSize("cifar10", 4, 1))
    part = make_partition({"scheme": "iid", "clients": 2}, 0, lab["train"]["y"], lab["test"]["y"])
    class_counts(part, lab["train"]["y"], lab["test"]["y"]).to_csv(tmp_path / "p.csv", index=False)
    drawn = {}
    monkeypatch.setattr(plotting, "save_figure", lambda fig, png, pdf: drawn.update({str(png): fig}))
    fig_cfg = {"kind": "partition_counts", "caption": "Fig. 7", "clients": [0, 1], "per_panel": 2, "split": "train"}
    for scale in ("smoke", "mini"):
        render.render_figure(fig_cfg, {"partition": str(tmp_path / "p.csv")}, f"{scale}.png", f"{scale}.pdf",
                             {"scale": scale, "seed": 0})
        assert (BANNER in figure_notes(drawn[f"{scale}.png"])) == (scale == "smoke")
