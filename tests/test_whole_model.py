"""Entire-model methods (base.WholeModelMethod): random or pretrained start, BatchNorm trained and carried in the
client state, heterogeneous widths joined by a projection; FedAvg averages the whole model."""
from __future__ import annotations

import torch

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.methods.fedavg import FedAvg
from fedcore.train import train_run


def _adapter(arch: str, seed: int):
    torch.manual_seed(seed)
    return prompt_adapter(build_backbone(arch))


def test_random_init_redraws_every_backbone_tensor_and_is_seeded():
    pretrained = _adapter("resnet_mini_18", 1)
    reference = {k: v.clone() for k, v in pretrained.resnet.state_dict().items()}
    torch.manual_seed(5)
    a = FedAvg(_adapter("resnet_mini_18", 1), 4, {"init": "random"}).model
    torch.manual_seed(5)
    b = FedAvg(_adapter("resnet_mini_18", 1), 4, {"init": "random"}).model
    kept = FedAvg(_adapter("resnet_mini_18", 1), 4, {"init": "pretrained"}).model
    for k, v in a.net.state_dict().items():
        assert torch.equal(v, b.net.state_dict()[k]), k
        assert torch.equal(kept.net.state_dict()[k], reference[k]), k
        if k.endswith("conv1.weight"):
            assert not torch.equal(v, reference[k]), k
    assert all(p.requires_grad for p in a.parameters())


def test_heterogeneous_widths_share_a_head_shape_through_the_projection():
    method = FedAvg([_adapter("resnet_mini_18", 1), _adapter("resnet_mini_50", 2)], 4, {"common_dim": 64},
                    client_backbones=[0, 1])
    small, large = method.models
    assert isinstance(small.proj, torch.nn.Linear) and small.proj.in_features == 128
    assert large.proj.in_features == 512 and small.head.weight.shape == large.head.weight.shape == (4, 64)


def test_fedavg_trains_and_averages_batchnorm_statistics(hetero_files, tmp_path):
    params = {**run_params(rounds=1, participation=1.0), "method_params": {"init": "random"}}
    res = train_run(params, identity("fedavg"), hetero_files["dataset"], hetero_files["partition5"],
                    "resnet_mini_18", hetero_files["weights"]["resnet_mini_18"], tmp_path / "m.parquet",
                    tmp_path / "f.pt", progress=False)
    state = res.server_state["model"]
    mean = state["net.bn1.running_mean"]
    assert mean.abs().sum() > 0                     # BatchNorm ran in train mode: its statistics moved from 0
    assert "net.bn1.num_batches_tracked" in state and "head.weight" in state


def test_a_last_batch_of_one_sample_is_skipped_only_when_batchnorm_trains(hetero_files, tmp_path):
    """17 samples at batch 16 leave a last batch of one: a trained BatchNorm cannot normalise it (torch raises)."""
    import numpy as np

    from fedcore.engine.loop import trains_batchnorm
    from fedcore.partition.file import Partition

    part = Partition.load(hetero_files["partition5"])
    part.train = [t[:17] for t in part.train]
    part.save(tmp_path / "p17.npz")
    params = {**run_params(rounds=1, participation=1.0), "method_params": {"init": "random"}}
    res = train_run(params, identity("fedavg"), hetero_files["dataset"], tmp_path / "p17.npz", "resnet_mini_18",
                    hetero_files["weights"]["resnet_mini_18"], tmp_path / "m.parquet", tmp_path / "f.pt",
                    progress=False)
    assert int(res.server_state["model"]["net.bn1.num_batches_tracked"]) == 1    # one batch of 16, not two
    assert np.isfinite(res.metrics["value"]).all()
    assert trains_batchnorm(FedAvg(_adapter("resnet_mini_18", 1), 4).model)
    assert not trains_batchnorm(FedAvg(_adapter("vit_mini", 1), 4).model)


def test_drop_last_skips_a_clients_incomplete_batch_only_when_it_holds_a_whole_one(hetero_files, tmp_path):
    """``federation.drop_last`` (FedOTP's code: Dassl's train loader drops the last incomplete batch when a client
    holds >= batch_size samples): 20 samples at batch 16 train one batch, not two; a client of 10 keeps its batch.
    BatchNorm's ``num_batches_tracked`` counts the batches each client trained (one local epoch)."""
    from fedcore.partition.file import Partition

    part = Partition.load(hetero_files["partition5"])
    counts = {}
    for n in (20, 10):
        part.train = [t[:n] for t in part.train]
        part.save(tmp_path / f"p{n}.npz")
        for drop in (False, True):
            params = {**run_params(rounds=1, participation=1.0, drop_last=drop), "method_params": {"init": "random"}}
            res = train_run(params, identity("fedavg"), hetero_files["dataset"], tmp_path / f"p{n}.npz",
                            "resnet_mini_18", hetero_files["weights"]["resnet_mini_18"], tmp_path / f"m{n}{drop}.parquet",
                            tmp_path / f"f{n}{drop}.pt", progress=False)
            counts[n, drop] = int(res.server_state["model"]["net.bn1.num_batches_tracked"])
    assert counts == {(20, False): 2, (20, True): 1, (10, False): 1, (10, True): 1}


def test_pool_projection_averages_groups_of_features_without_parameters():
    from fedcore.methods.base import FeaturePool, WholeModelClassifier

    x = torch.arange(16.0).reshape(2, 8)
    assert torch.equal(FeaturePool(2)(x), torch.tensor([[1.5, 5.5], [9.5, 13.5]]))   # means of 4
    pooled = WholeModelClassifier(torch.nn.Identity(), 8, 3, common_dim=2, projection="pool")
    linear = WholeModelClassifier(torch.nn.Identity(), 8, 3, common_dim=2)
    assert sum(p.numel() for p in pooled.parameters()) == 2 * 3 + 3                   # the head only
    assert sum(p.numel() for p in linear.parameters()) == 8 * 2 + 2 + 2 * 3 + 3
    assert torch.allclose(pooled.features(x), FeaturePool(2)(x))
