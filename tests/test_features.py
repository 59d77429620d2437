"""Cached frozen features: the Select queries equal the frozen backbone's final-norm CLS after the block."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.vit import backbone_info, build_vit
from fedcore.data.arrays import save_bundle
from fedcore.engine.data import Batch, DeviceSplit, InputPipeline, iterate_batches
from fedcore.artifacts.select_queries import (compute_select_queries, layer_features, load_select_queries,
                                              read_select_queries)
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
    # the same rows in the same batches: bit for bit the stopped forward's CLS
    one = layer_features(backbone, split, pipe, [3, 0], batch_size=len(split.y))
    with torch.no_grad():
        for b in (0, 3):
            assert np.array_equal(one[b], backbone.forward_tokens(x, None, stop_block=b)[:, 0].numpy())
    some = layer_features(backbone, split, pipe, [2], batch_size=3, indices=torch.tensor([4, 0, 4]))
    np.testing.assert_array_equal(some[2][0], some[2][2])
    assert layer_features(backbone, split, pipe, [2], indices=torch.tensor([], dtype=torch.long))[2].shape == (0, 64)


def test_select_queries_file_round_trip_and_checks(tmp_path):
    torch.manual_seed(0)
    torch.save(build_vit("vit_mini").state_dict(), tmp_path / "vit.pt")
    bundle = synthetic_bundle(n_train=30, n_test=10)
    save_bundle(bundle, tmp_path / "data.npz")
    compute_select_queries(tmp_path / "data.npz", "vit_mini", tmp_path / "vit.pt", 2, tmp_path / "q.npz", device="cpu")
    train, test, meta = read_select_queries(tmp_path / "q.npz")
    assert train.shape == (30, 64) and test.shape == (10, 64) and meta["block"] == 2
    tr, te = load_select_queries(tmp_path / "q.npz", 30, 10, 2, torch.device("cpu"))
    split = DeviceSplit(torch.from_numpy(bundle.train.x), torch.from_numpy(bundle.train.y), extras={"query": tr})
    pipe = InputPipeline(16, (0.5,) * 3, (0.5,) * 3)
    batch = next(iterate_batches(split, torch.arange(5), 5, pipe))
    assert isinstance(batch, Batch) and torch.equal(batch.extras["query"], tr[:5])   # batches carry their queries
    with pytest.raises(ValueError, match="31/10"):
        load_select_queries(tmp_path / "q.npz", 31, 10, 2, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match="features rule"):
        read_select_queries(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="outside vit_mini's blocks"):
        compute_select_queries(tmp_path / "data.npz", "vit_mini", tmp_path / "vit.pt", 4, tmp_path / "q4.npz",
                               device="cpu")


def test_features_file_names_its_dataset_relative_to_the_working_directory(tmp_path, monkeypatch):
    """Two checkouts (working directories) given absolute paths write byte-identical features files."""
    torch.manual_seed(0)
    weights = build_vit("vit_mini").state_dict()
    files = []
    for checkout in ("a", "b"):
        root = tmp_path / checkout
        (root / "results" / "data").mkdir(parents=True)
        save_bundle(synthetic_bundle(n_train=12, n_test=4), root / "results" / "data" / "digits.npz")
        torch.save(weights, root / "vit.pt")
        monkeypatch.chdir(root)
        out = root / "results" / "features" / "q.npz"
        compute_select_queries(root / "results" / "data" / "digits.npz", "vit_mini", root / "vit.pt", 2, out,
                               device="cpu")
        assert read_select_queries(out)[2]["dataset"] == "results/data/digits.npz"
        files.append(out.read_bytes())
    assert files[0] == files[1]


def test_feature_and_tsne_jobs_check_the_weight_file_before_any_work(tmp_path):
    """A weight file whose sha256 is not the pinned one (or is unpinned) is refused before the dataset is read."""
    from fedcore.analysis.tsne import compute_tsne
    from fedcore.artifacts import build_artifact
    from fedcore.backbones.registry import UNPINNED, WeightFileError

    torch.save(build_vit("vit_mini").state_dict(), tmp_path / "vit.pt")
    missing = tmp_path / "no_such_dataset.npz"                    # reading it would fail differently
    for sha in ("0" * 64, UNPINNED):
        with pytest.raises(WeightFileError, match="sha256"):
            build_artifact("cls_block2", missing, "vit_mini", tmp_path / "vit.pt", tmp_path / "q.npz",
                           sha256=sha)
        with pytest.raises(WeightFileError, match="sha256"):
            compute_tsne(missing, "vit_mini", tmp_path / "vit.pt", {}, tmp_path / "t.npz", sha256=sha)
    assert not (tmp_path / "q.npz").exists() and not (tmp_path / "t.npz").exists()
