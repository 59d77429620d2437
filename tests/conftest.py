"""Shared fixtures: a tiny dataset bundle, a partition and a random-init vit_mini weight file."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import settings

from fedcore.backbones.registry import build_backbone
from fedcore.backbones.vit import build_vit
from fedcore.data.arrays import ArrayDataset, DatasetBundle, save_bundle
from fedcore.partition.make import make_partition

torch.set_num_threads(1)
# property tests draw the same examples on every run (a suite that passes once passes again) and keep no database
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")


def synthetic_bundle(n_train: int = 240, n_test: int = 80, classes: int = 4, seed: int = 0) -> DatasetBundle:
    """Class-dependent blobs on 16x16 RGB images: learnable in a few steps, cheap to build."""
    rng = np.random.default_rng(seed)

    def split(n: int) -> ArrayDataset:
        y = np.arange(n) % classes
        x = rng.integers(0, 60, size=(n, 16, 16, 3))
        for c in range(classes):
            r, col = divmod(c, 2)
            x[y == c, r * 8:(r + 1) * 8, col * 8:(col + 1) * 8, :] += 180
        return ArrayDataset(x=x.clip(0, 255).astype(np.uint8), y=y)

    return DatasetBundle(train=split(n_train), test=split(n_test),
                         meta={"classes": [str(c) for c in range(classes)], "source": "synthetic"})


@pytest.fixture(scope="session")
def tiny_run_files(tmp_path_factory):
    """Paths of a saved bundle, an IID 4-client partition and vit_mini weights."""
    root = tmp_path_factory.mktemp("tiny")
    bundle = synthetic_bundle()
    save_bundle(bundle, root / "data.npz")
    part = make_partition({"scheme": "iid", "clients": 4}, 0, bundle.train.y, bundle.test.y)
    part.save(root / "part.npz")
    torch.manual_seed(0)
    torch.save(build_vit("vit_mini").state_dict(), root / "vit_mini.pt")
    return {"dataset": root / "data.npz", "partition": root / "part.npz", "weights": root / "vit_mini.pt",
            "root": root}


def run_params(rounds: int = 3, participation: float = 0.5, **fed) -> dict:
    """Training params as rules/train.smk passes them (CFG.train_params)."""
    return {
        "paper": "sgpt",
        "federation": {"rounds": rounds, "participation": participation, "local_epochs": 1, "batch_size": 16, **fed},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
        "evaluation": {"global_test": "pooled_local"},
        "method_params": {},
        "final_window": 2,
    }


def identity(method: str, seed: int = 0) -> dict:
    """A run identity for tests."""
    return {"paper": "sgpt", "experiment": "tiny", "method": method, "scale": "mini", "dataset": "synthetic",
            "seed": seed}


@pytest.fixture(scope="session")
def learnable_run_files(tiny_run_files, tmp_path_factory):
    """``tiny_run_files`` with a vit_mini briefly pretrained on other blob images: a random-init vit_mini's
    CLS feature is nearly constant, so no method gets above chance on it (shared by the methods' tests)."""
    from fedcore.backbones.pretrain.supervised import pretrain_vit
    from fedcore.data.arrays import DatasetBundle

    pre = synthetic_bundle(n_train=240, n_test=8, seed=1)
    out = tmp_path_factory.mktemp("pretrained") / "vit_mini.pt"
    pretrain_vit(DatasetBundle(train=pre.train, test=pre.test, pretrain=pre.train, meta=pre.meta), epochs=10,
                 batch_size=32, lr=3e-3, seed=0, out_path=out, threads=1, progress=False)
    return {**tiny_run_files, "weights": out}


@pytest.fixture(scope="session")
def hetero_files(tiny_run_files, tmp_path_factory):
    """Five IID clients each tested on the full test set (FedHPL's setting; client_backbones [0, 1, 2, 1, 0]
    gives its S/B/L/B/S order) and random weights of the tiny ViTs and ResNets."""
    root = tmp_path_factory.mktemp("hetero")
    bundle = synthetic_bundle()
    make_partition({"scheme": "iid", "clients": 5, "test": "full"}, 0, bundle.train.y, bundle.test.y).save(
        root / "part5.npz")
    weights = {}
    for i, arch in enumerate(("vit_mini_s", "vit_mini", "vit_mini_l", "resnet_mini_18", "resnet_mini_34",
                              "resnet_mini_50")):
        torch.manual_seed(10 + i)
        weights[arch] = root / f"{arch}.pt"
        torch.save(build_backbone(arch).state_dict(), weights[arch])
    return {**tiny_run_files, "partition5": root / "part5.npz", "weights": weights}


def whole_run(files: dict, out, method: str, arch: str, rounds: int = 2, stop: int | None = None, **method_params):
    """A run of an entire-model method on ``hetero_files``' five IID clients with one architecture (FedHPL's
    homogeneous setting), every client scored on the full test set with per-class rows."""
    from fedcore.train import train_run

    out.mkdir(exist_ok=True)
    params = {**run_params(rounds=rounds, participation=1.0), "method_params": method_params,
              "evaluation": {"global_test": "official_test", "per_class": True}}
    return train_run(params, identity(method), files["dataset"], files["partition5"], arch, files["weights"][arch],
                     out / "m.parquet", out / "f.pt", checkpoint_path=out / "ckpt.pt", progress=False,
                     stop_after_round=stop)


@pytest.fixture(scope="session")
def pft_files(tiny_run_files, tmp_path_factory):
    """``tiny_run_files``' blobs split as FedPFT splits CIFAR (spec fedpft §3): 4 clients, each its own Dir(0.5)
    class mix, 40 train and 16 test samples with the same mix."""
    from fedcore.data.arrays import load_bundle

    bundle = load_bundle(tiny_run_files["dataset"])
    root = tmp_path_factory.mktemp("pft")
    spec = {"scheme": "dirichlet_per_client", "clients": 4, "alpha": 0.5, "train_per_client": 40,
            "test_per_client": 16}
    make_partition(spec, 0, bundle.train.y, bundle.test.y).save(root / "part.npz")
    return {**tiny_run_files, "partition": root / "part.npz"}


def scratch_run(files: dict, out, method: str, arch: str = "resnet8_pft_mini", rounds: int = 2,
                stop: int | None = None, participation: float = 1.0, local_epochs: int = 1, **method_params):
    """A run of an entire-model method on a backbone drawn at random by the run (``scratch: true``, FedPFT's
    extractors) on ``pft_files``' four Non-IID clients, each scored on its own test set."""
    from fedcore.train import train_run

    out.mkdir(exist_ok=True)
    params = {**run_params(rounds=rounds, participation=participation, local_epochs=local_epochs),
              "method_params": method_params}
    return train_run(params, identity(method), files["dataset"], files["partition"], arch, None, out / "m.parquet",
                     out / "f.pt", checkpoint_path=out / "ckpt.pt", progress=False, stop_after_round=stop)


@pytest.fixture(scope="session")
def tiny_method_root(tmp_path_factory):
    """Where tests/every_method.py builds the mini datasets, cut partitions and artifacts (once per worker)."""
    return tmp_path_factory.mktemp("every_method")


@pytest.fixture(scope="session")
def smoke_config():
    """Every paper at scale smoke, every output (the whole smoke DAG's config; tests/test_smoke*.py)."""
    from pathlib import Path

    from fedcore.config import load_config

    root = Path(__file__).resolve().parents[1]
    return load_config({"scale": "smoke", "seeds": [0], "papers": ["sgpt", "fedhpl", "fedotp", "fedpft"],
                        "outputs": "all"}, root)


def edited_config(tmp_path: Path, paper: str, edit) -> Path:
    """A root under ``tmp_path`` holding a copy of config/ with ``edit`` applied to ``paper``'s experiments (a dict of
    experiment name -> experiment, edited in place)."""
    shutil.copytree(Path(__file__).resolve().parents[1] / "config", tmp_path / "config")
    path = tmp_path / "config" / "experiments" / f"{paper}.yaml"
    doc = yaml.safe_load(path.read_text())
    edit(doc["experiments"])
    path.write_text(yaml.safe_dump(doc))
    return tmp_path
