"""A truncated or corrupt file is named in the error, called unreadable, with the way to get a good copy.

One test per file kind, each through the loader its consumers use, at the path the pipeline gives it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedcore.artifacts import load_artifact
from fedcore.backbones.registry import ARCH_SPECS, WeightFileError, build_backbone, pretrained_cfg
from fedcore.data.arrays import load_bundle, save_bundle
from fedcore.artifacts.select_queries import FORMAT
from fedcore.partition.file import Partition
from fedcore.partition.make import make_partition
from tests.conftest import synthetic_bundle

ROOT = Path(__file__).resolve().parents[1]
REBUILD = "delete it and rerun snakemake, which rebuilds it with rule {}"


def _truncate(path: Path) -> Path:
    """Keep the first half of the file, as an interrupted copy or download does."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _expect(path: Path, error: str, recover: str) -> str:
    """The pattern of the message: the file's path, unreadable or incomplete, the library's error, the fix."""
    return rf"^{re.escape(str(path))} is unreadable or incomplete \({error}: .*\): {re.escape(recover)}"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run from a scratch working directory so that paths read like the pipeline's (results/...)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_pipeline_weight_file(in_tmp, suffix):
    from safetensors.torch import save_file

    path = Path("results/backbones") / f"vit_mini{suffix}"
    path.parent.mkdir(parents=True)
    sd = build_backbone("vit_mini").state_dict()
    torch.save(sd, path) if suffix == ".pt" else save_file(sd, str(path))
    _truncate(path)
    with pytest.raises(WeightFileError, match=_expect(path, r"\w+", REBUILD.format("pretrain_backbone"))):
        build_backbone("vit_mini", path)


@pytest.mark.parametrize("arch, name", [("vit_base_patch16_224", "vit_base_patch16_224.orig_in21k.safetensors"),
                                        ("resnet18", "resnet18.tv_in1k.pt")])
def test_user_weight_file(in_tmp, arch, name):
    """A paper-scale file the user placed (timm and torchvision builders): fetch it again, which entry it is."""
    path = Path("resources/weights") / name
    path.parent.mkdir(parents=True)
    torch.save({"w": torch.zeros(1000)}, path)  # a valid .pt, or bytes the safetensors reader rejects
    _truncate(path)
    recover = (f"download it again or replace it with a complete copy: it is the `weights:` file {name!r} of the "
               f"backbone entry with `arch: {arch}` in config/backbones.yaml")
    with pytest.raises(WeightFileError, match=_expect(path, r"\w+", recover)):
        build_backbone(arch, path)


def test_weight_rules_match_backbones_yaml():
    """The message's choice (rebuild vs fetch again) follows config/backbones.yaml: pretrain -> rule."""
    entries = yaml.safe_load((ROOT / "config" / "backbones.yaml").read_text())
    for name, entry in entries.items():
        cfg = pretrained_cfg(entry["arch"], entry.get("tag"))
        assert cfg.rule == ("pretrain_backbone" if "pretrain" in entry else ""), name
    # hub-built archs come from a user's file, unless the pipeline pretrains them (the mini CLIP, open_clip-built)
    pretrained = {e["arch"] for e in entries.values() if "pretrain" in e}
    assert all(pretrained_cfg(a).rule == "" for a, s in ARCH_SPECS.items()
               if s.source != "fedcore" and a not in pretrained)


def test_features_file(in_tmp):
    path = Path("results/features/vit_mini/digits/cls_block3.npz")
    path.parent.mkdir(parents=True)
    meta = json.dumps({"format": FORMAT, "arch": "vit_mini", "block": 3, "dataset": "results/data/digits.npz"})
    np.savez(path, train=np.zeros((30, 64), np.float32), test=np.zeros((10, 64), np.float32), meta=meta)
    assert load_artifact("cls_block3", path, 30, 10, torch.device("cpu"))[0].shape == (30, 64)
    _truncate(path)
    with pytest.raises(ValueError, match=_expect(path, "BadZipFile", REBUILD.format("features"))):
        load_artifact("cls_block3", path, 30, 10, torch.device("cpu"))


def test_dataset_file(in_tmp):
    path = Path("results/data/digits.npz")
    save_bundle(synthetic_bundle(n_train=40, n_test=8), path)
    good = path.read_bytes()
    _truncate(path)
    with pytest.raises(ValueError, match=_expect(path, "BadZipFile", REBUILD.format("build_dataset"))):
        load_bundle(path)
    # damage inside the images (the zip index intact) is caught too, by the CRC of the member
    bad = bytearray(good)
    bad[len(bad) // 3] ^= 0xFF
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match=_expect(path, "BadZipFile", REBUILD.format("build_dataset"))):
        load_bundle(path)


def test_partition_file(in_tmp):
    path = Path("results/partitions/digits/iid-0123abcd/seed0.npz")
    y = np.arange(40) % 4
    make_partition({"scheme": "iid", "clients": 2}, 0, y, y).save(path)
    _truncate(path)
    with pytest.raises(ValueError, match=_expect(path, "BadZipFile", REBUILD.format("partition"))):
        Partition.load(path)


def test_torch_files_are_byte_identical_across_writes(tmp_path) -> None:
    """A .pt names its inner archive after the file torch.save is given; atomic writes must not leak their
    random temporary name into the bytes (two equal runs gave different checkpoint and backbone files)."""
    import torch

    from fedcore.io import atomic_torch_save

    obj = {"w": torch.arange(6.0).reshape(2, 3), "meta": {"round": 3}}
    atomic_torch_save(obj, tmp_path / "a.pt")
    atomic_torch_save(obj, tmp_path / "b" / "a.pt")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b" / "a.pt").read_bytes()
    assert torch.equal(torch.load(tmp_path / "a.pt")["w"], obj["w"])
