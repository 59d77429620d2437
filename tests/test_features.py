"""Cached frozen features: the Select queries equal the frozen backbone's final-norm CLS after the block."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.vit import backbone_info, build_vit
from fedcore.data.arrays import save_bundle
from fedcore.engine.data import DeviceSplit, InputPipeline, QueryBatch, iterate_batches
from fedcore.features import compute_select_queries, layer_features, load_select_queries, read_select_queries
from tests.conftest import synthetic_bundle


def test_layer_features_equal_a_stopped_forward():
    torch.manual_seed(0)
    vit = build_vit("vit_mini")
    info = backbone_info(vit)
    backbone, pipe = PromptedViT(vit), InputPipeline(info["img_size"], info["mean"], info["std"])
    split = DeviceSplit.from_arrays(synthetic_bundle(n_train=20, n_test=4).train, torch.device("cpu"))
    feats = layer_features(backbone, split, pipe, [1, 3], batch_size=7)
    with torch.no_grad():
        x = pipe(split.x)
        for b in (1, 3):
            ref = backbone.forward_tokens(x, None, stop_block=b)[:, 0].numpy()
            np.testing.assert_allclose(feats[b], ref, atol=1e-5)


def test_select_queries_file_round_trip_and_checks(tmp_path):
    torch.manual_seed(0)
    torch.save(build_vit("vit_mini").state_dict(), tmp_path / "vit.pt")
    bundle = synthetic_bundle(n_train=30, n_test=10)
    save_bundle(bundle, tmp_path / "data.npz")
    compute_select_queries(tmp_path / "data.npz", "vit_mini", tmp_path / "vit.pt", 2, tmp_path / "q.npz", device="cpu")
    train, test, meta = read_select_queries(tmp_path / "q.npz")
    assert train.shape == (30, 64) and test.shape == (10, 64) and meta["block"] == 2
    tr, te = load_select_queries(tmp_path / "q.npz", 30, 10, 2, torch.device("cpu"))
    split = DeviceSplit(torch.from_numpy(bundle.train.x), torch.from_numpy(bundle.train.y), queries=tr)
    pipe = InputPipeline(16, (0.5,) * 3, (0.5,) * 3)
    batch, _ = next(iterate_batches(split, torch.arange(5), 5, pipe))
    assert isinstance(batch, QueryBatch) and torch.equal(batch.query, tr[:5])   # batches carry their queries
    with pytest.raises(ValueError, match="31/10"):
        load_select_queries(tmp_path / "q.npz", 31, 10, 2, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match="select_features"):
        read_select_queries(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="outside vit_mini's blocks"):
        compute_select_queries(tmp_path / "data.npz", "vit_mini", tmp_path / "vit.pt", 4, tmp_path / "q4.npz",
                               device="cpu")
