"""The CPU subset of scale smoke: one run per paper at the paper's backbone sizes (ViT-B/16 at 224 px for SGPT and
FedHPL, CLIP ViT-B/16 for FedOTP, FedPFT's ResNet-8 at 32 px), so that the paper-only code paths (random-weight
construction of the paper backbones, 32 -> 224 px resizing on the device, the papers' client counts and partition
schemes, the synthetic analogues' shapes) run in every test suite, under the CPU proxy of CUDA's rules (bf16
autocast, strict deterministic mode's refusals: ``cuda_rules_on_cpu``) but for FedHPL's run.

Each run is the smoke scale's own (config/scales/smoke.yaml: its backbones, method params, partition scheme and
client count) made CPU-sized: a few images of its synthetic analogue, one local epoch, one client trained, so a
ViT-B run forwards about ten images. What is cut is listed per run in CI_RUNS.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pandas as pd
import pytest
import torch

from fedcore.artifacts import build_artifact
from fedcore.data.arrays import ArrayDataset, DatasetBundle, save_bundle
from fedcore.data.facts import SYNTHETIC, SyntheticSize
from fedcore.data.synthetic import build_synthetic
from fedcore.engine.precision import cuda_rules_on_cpu
from fedcore.partition.make import make_partition
from fedcore.partition.spec import num_clients
from fedcore.plan import plan_run
from fedcore.train import train_run

# paper -> (experiment, method, images kept per domain (or of the split) in train and test, partition keys that
# shrink its sample counts to those images, federation keys besides one client a round); one local epoch where the
# method allows (FedPFT's alternating phases need the paper's 5: R_f = 3 of them, on 2 images)
CI_RUNS = {
    "sgpt": ("sgpt_office", "sgpt", (1, 1), {"train_fraction_of_min": 1.0}, {"local_epochs": 1}),
    "fedhpl": ("hpl_c10_iid_homo", "fedhpl", (5, 1), {}, {"local_epochs": 1}),
    "fedotp": ("otp_office_feature", "fedotp", (1, 1), {}, {"local_epochs": 1}),
    "fedpft": ("pft_c10_dir0p1", "fedpft", (10, 10), {"train_per_client": 2, "test_per_client": 1}, {}),
}


@pytest.fixture
def smoke(smoke_config):
    """The smoke scale, the four papers (conftest.py)."""
    return smoke_config


def tiny_bundle(name: str, keep: tuple[int, int]) -> DatasetBundle:
    """Analogue ``name``'s shape at one image per class (and domain), cut to its first ``keep`` images of every
    domain (of the whole split without domains) in train and test."""
    full = build_synthetic(name, SyntheticSize(SYNTHETIC[name].like, 1, 1))

    def cut(ds: ArrayDataset, n: int) -> ArrayDataset:
        groups = ds.domain if ds.domain is not None else np.zeros(len(ds.y), np.int64)
        idx = np.sort(np.concatenate([np.flatnonzero(groups == g)[:n] for g in np.unique(groups)]))
        pick = lambda a: None if a is None else a[idx]  # noqa: E731
        return ArrayDataset(x=ds.x[idx], y=ds.y[idx], domain=pick(ds.domain), coarse=pick(ds.coarse))

    return DatasetBundle(train=cut(full.train, keep[0]), test=cut(full.test, keep[1]), meta=full.meta)


@pytest.mark.parametrize("paper", sorted(CI_RUNS))
def test_smoke_run_at_paper_backbone_size_on_cpu(paper, smoke, tmp_path):
    experiment, method, keep, shrink, federation = CI_RUNS[paper]
    plan = plan_run(smoke, experiment, method, 0)   # the smoke run as the pipeline plans it
    params = plan.params
    spec = {**params["partition"], **shrink}
    bundle = tiny_bundle(plan.dataset, keep)
    clients = num_clients(spec, len(bundle.meta.get("domains", [])))
    paper_spec = smoke.at_scale("paper").experiments[experiment]["partition"]
    assert clients == num_clients(paper_spec, len(bundle.meta.get("domains", [])))  # the paper's client count
    params["partition"] = spec
    params["federation"] = {**params["federation"], **federation, "participation": 1.0 / clients}
    save_bundle(bundle, tmp_path / "data.npz")
    part = make_partition(spec, 0, bundle.train.y, bundle.test.y, bundle.train.domain, bundle.test.domain,
                          bundle.train.coarse, bundle.test.coarse)
    assert part.num_clients == clients
    part.save(tmp_path / "part.npz")
    archs = plan.archs if isinstance(plan.archs, list) else [plan.archs]
    artifacts = {}
    for name, key in plan.artifacts.items():  # SGPT's Select queries, FedOTP's CLIP image tokens
        artifacts[name] = tmp_path / f"{key}.npz"
        torch.manual_seed(0)
        build_artifact(key, tmp_path / "data.npz", archs[0].partition(".")[0], None, artifacts[name], device="cpu")
    # CUDA's rules (bf16 autocast, strict mode's refusals) on the paper-only paths; FedHPL's ViT-B run is SGPT's code
    # path with other prompts, and bf16 matmuls on the CPU would double its time
    with cuda_rules_on_cpu() if paper != "fedhpl" else contextlib.nullcontext():
        train_run(params, plan.identity, tmp_path / "data.npz", tmp_path / "part.npz", plan.archs, None,
                  tmp_path / "m.parquet", tmp_path / "final.pt", device="cpu", progress=False, artifacts=artifacts)
    metrics = pd.read_parquet(tmp_path / "m.parquet")
    assert set(metrics["round"]) == {1} and (metrics["scale"] == "smoke").all()
    acc = metrics.loc[metrics["metric"] == "acc", "value"]   # every client's and the global test accuracy
    if params["evaluation"]["global_test"] == "none":   # FedOTP: each client's own test set only
        assert len(acc) == clients and not (metrics["split"] == "global").any()
    else:
        assert len(acc) > clients
    assert acc.notna().all() and acc.between(0, 1).all()
    final = torch.load(tmp_path / "final.pt", weights_only=False)
    assert [r["arch"] for r in final["backbone_weights"]] == archs
