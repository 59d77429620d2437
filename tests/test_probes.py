"""Probes behind SGPT Table 5 and Figs. 5 and 6a: congruence, parameter counts, t-SNE features."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedcore.analysis.clustering import (
    congruence, hungarian_accuracy, kmeans_clusters, majority_fraction, overlap_accuracy, query_l2, relu_l2,
)
from fedcore.analysis.congruence import MISSING_RUN, NO_KEYS, NOT_CONFIGURED, OK, congruence_table, write_congruence
from fedcore.analysis.params import NOT_IMPLEMENTED, param_counts, write_param_counts
from fedcore.analysis.probe_files import read_tsne
from fedcore.analysis.tsne import balanced_subsample, compute_tsne
from fedcore.report.fig_probes import tsne_figure
from fedcore.report.plotting import figure_notes

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------------
# Congruence (Fig. 6a)
# ----------------------------------------------------------------------------------------------

LABELS = np.array([0, 0, 0, 0, 1, 1, 1, 1])
KMEANS = np.array([0, 0, 0, 1, 1, 1, 1, 1])


def test_majority_fraction_is_q_kmeans():
    # class 0: 3 of 4 in cluster 0; class 1: 4 of 4 in cluster 1 -> (3 + 4) / 8
    assert majority_fraction(LABELS, KMEANS) == pytest.approx(0.875)


def test_overlap_rows_are_groups_so_collapse_is_not_perfect():
    groups = np.array([2, 2, 2, 2, 0, 0, 0, 0])
    # group 2 holds K-Means {0: 3, 1: 1} -> 3; group 0 holds {1: 4} -> 4; (3 + 4) / 8
    assert overlap_accuracy(groups, KMEANS) == pytest.approx(0.875)
    collapsed = np.zeros(8, dtype=int)
    assert overlap_accuracy(collapsed, KMEANS) == pytest.approx(5 / 8)  # the largest K-Means cluster's share


def test_congruence_is_overlap_over_q():
    score = congruence(np.array([2, 2, 2, 2, 0, 0, 0, 0]), KMEANS, LABELS)
    assert score == pytest.approx({"acc_overlap": 0.875, "q_kmeans": 0.875, "congruence": 1.0})
    collapsed = congruence(np.zeros(8, dtype=int), KMEANS, LABELS)
    assert collapsed["congruence"] == pytest.approx((5 / 8) / 0.875)


def test_hungarian_and_relu_l2_unchanged_contract():
    assert hungarian_accuracy(np.array([1, 1, 0, 0]), np.array([0, 0, 1, 1])) == pytest.approx(1.0)
    x = relu_l2(np.array([[3.0, -4.0, 4.0], [0.0, -1.0, 0.0]]))
    np.testing.assert_allclose(x, [[0.6, 0.0, 0.8], [0.0, 0.0, 0.0]], atol=1e-7)


def _blobs(n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two well separated query blobs along the two axes (plus noise dims), labels = blob."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 2
    q = rng.normal(0, 0.05, size=(n, 4)).astype(np.float32)
    q[labels == 0, 0] += 1.0
    q[labels == 1, 1] += 1.0
    return q, labels


def _final(path: Path, keys: torch.Tensor | None) -> Path:
    glob = {"head.weight": torch.zeros(2, 4)} if keys is None else {"keys": keys, "head.weight": torch.zeros(2, 4)}
    torch.save({"identity": {"method": "sgpt"}, "global": glob, "personal": {}, "server": {}}, path)
    return path


def test_congruence_table_statuses_and_values(tmp_path: Path):
    q, labels = _blobs()
    aligned = _final(tmp_path / "a.pt", torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
    collapsed = _final(tmp_path / "b.pt", torch.tensor([[1.0, 1.0, 0, 0], [-1.0, -1.0, 0, 0]]))
    no_keys = _final(tmp_path / "c.pt", None)
    points = [{"value": 0.5, "method": "sgpt", "seed": 0, "path": str(aligned)},
              {"value": 0.0, "method": "sgpt_qg", "seed": 0, "path": str(collapsed)},
              {"value": 0.1, "method": "sgpt_ak0p1", "seed": 0, "path": str(tmp_path / "absent.pt")},
              {"value": 0.3, "method": "sgpt_ak0p3", "seed": 0, "status": NOT_CONFIGURED},
              {"value": 0.9, "method": "share_only", "seed": 0, "path": str(no_keys)}]
    table = congruence_table(q, labels, "coarse", points, k=2, seed=0)
    by = table.set_index("method")
    assert list(table["status"]) == [OK, OK, MISSING_RUN, NOT_CONFIGURED, NO_KEYS]
    assert by.loc["sgpt", "congruence"] == pytest.approx(1.0)  # groups = K-Means = blobs, Q = 1
    assert by.loc["sgpt", "q_kmeans"] == pytest.approx(1.0)
    assert by.loc["sgpt_qg", "acc_overlap"] == pytest.approx(0.5)  # everything in one group
    assert table.loc[table["status"] != OK, "congruence"].isna().all()


def test_congruence_uses_each_runs_query_transform(tmp_path: Path):
    """K-Means and the run's groups see the queries as the run's Select did: raw (the paper, the default) or ReLU'd
    (``query_relu``, the official code). Two blobs that differ only in a negative coordinate merge under the ReLU."""
    from fedcore.methods.sgpt import select_groups

    rng = np.random.default_rng(1)
    labels = np.arange(40) % 2
    q = rng.normal(0, 0.05, size=(40, 4)).astype(np.float32)
    q[:, 0] += 1.0
    q[labels == 1, 1] -= 1.0                       # blob 1 only differs in a negative coordinate
    keys = torch.tensor([[1.0, 0, 0, 0], [1.0, -1.0, 0, 0]])
    final = _final(tmp_path / "a.pt", keys)
    points = [{"value": 0.0, "method": "sgpt", "seed": 0, "path": str(final)},
              {"value": 1.0, "method": "sgpt_relu", "seed": 0, "path": str(final), "query_relu": False},
              {"value": 2.0, "method": "sgpt_code2024", "seed": 0, "path": str(final), "query_relu": True}]
    by = congruence_table(q, labels, "coarse", points, k=2, seed=0).set_index("method")
    assert by.loc["sgpt", "congruence"] == pytest.approx(1.0) and by.loc["sgpt", "q_kmeans"] == pytest.approx(1.0)
    assert by.loc["sgpt_relu", "congruence"] == pytest.approx(1.0)   # explicit false = the default
    relu = congruence(select_groups(torch.from_numpy(q), keys, relu=True).numpy(),
                      kmeans_clusters(query_l2(q, relu=True), 2, 0, 10), labels)
    assert by.loc["sgpt_code2024", ["acc_overlap", "q_kmeans", "congruence"]].tolist() == \
        pytest.approx([relu["acc_overlap"], relu["q_kmeans"], relu["congruence"]])
    assert relu["q_kmeans"] < 0.9                  # the ReLU merged the blobs: a different reference
    np.testing.assert_allclose(query_l2(q, relu=True), relu_l2(q))


def test_write_congruence_reads_cached_queries(tmp_path: Path, tiny_run_files):
    from fedcore.data.arrays import load_bundle

    bundle = load_bundle(tiny_run_files["dataset"])
    n_train = len(bundle.train.y)
    rng = np.random.default_rng(0)
    train = rng.normal(size=(n_train, 4)).astype(np.float32)
    queries = tmp_path / "select_block3.npz"
    with open(queries, "wb") as f:  # the features rule's cls_block file format
        np.savez(f, train=train, test=train[:5], meta='{"format": "fedcore-select-queries-v1", "block": 3}')
    final = _final(tmp_path / "final.pt", torch.eye(4)[:3])
    out = tmp_path / "probe" / "congruence.csv"
    table = write_congruence(queries, tiny_run_files["dataset"],
                             [{"value": 0.5, "method": "sgpt", "seed": 0, "path": str(final)}], 3, 0, out)
    back = pd.read_csv(out)
    assert back.loc[0, "status"] == OK and back.loc[0, "labels"] == "fine"  # the synthetic set has no coarse labels
    assert back.loc[0, "congruence"] == pytest.approx(table.loc[0, "congruence"], rel=1e-5)
    assert sorted(p.name for p in out.parent.iterdir()) == ["congruence.csv"]


# ----------------------------------------------------------------------------------------------
# Parameter counts (Table 5)
# ----------------------------------------------------------------------------------------------

SGPT_C100_S10 = {"groups": 20, "shared_blocks": [0, 1, 2, 3], "group_blocks": [4, 5, 6], "select_block": 11}


def test_param_counts_match_known_values(tmp_path: Path):
    models = [
        {"source": "torchvision", "arch": "resnet18", "num_classes": 100},
        {"source": "timm", "arch": "vit_base_patch16_224", "num_classes": 100},
        {"source": "method", "method": "sgpt", "base": "sgpt", "experiment": "sgpt_c100_s10",
         "arch": "vit_base_patch16_224", "num_classes": 100, "params": SGPT_C100_S10},
        {"source": "method", "method": "sgpt_x", "base": "no_such_method", "arch": "vit_mini", "num_classes": 10},
    ]
    out = tmp_path / "param_counts.csv"
    counts = write_param_counts(models, out)
    assert counts.loc[0, "trainable"] == 11_227_812  # ResNet-18, 100 classes
    assert counts.loc[1, "trainable"] == 85_875_556  # ViT-B/16, 100 classes
    # spec: head 76,900 + shared 3,072 + group 46,080 + keys 15,360; the frozen backbone is not counted
    assert counts.loc[2, "trainable"] == 141_412 and counts.loc[2, "total"] > 85_000_000
    assert counts.loc[3, "status"] == NOT_IMPLEMENTED and pd.isna(counts.loc[3, "trainable"])
    assert (counts.loc[:2, "device"] == "meta").all()
    back = pd.read_csv(out)
    assert list(back["trainable"].iloc[:3]) == [11_227_812, 85_875_556, 141_412]


def test_param_counts_resnet50():
    counts = param_counts([{"source": "torchvision", "arch": "resnet50", "num_classes": 100}])
    assert counts.loc[0, "trainable"] == 23_712_932


# ----------------------------------------------------------------------------------------------
# t-SNE (Fig. 5)
# ----------------------------------------------------------------------------------------------

def test_balanced_subsample_is_balanced_and_seeded():
    labels = np.array([0] * 10 + [1] * 3 + [2] * 7)
    idx = balanced_subsample(labels, 4, seed=1)
    assert np.bincount(labels[idx]).tolist() == [4, 3, 4]  # a small class gives what it has
    assert np.array_equal(idx, np.sort(idx)) and len(set(idx)) == len(idx)
    assert np.array_equal(idx, balanced_subsample(labels, 4, seed=1))
    assert not np.array_equal(idx, balanced_subsample(labels, 4, seed=2))


def test_tsne_probe_and_figure(tmp_path: Path, tiny_run_files):
    cfg = {"kind": "tsne", "experiment": "e", "blocks": [0, 3], "per_class": 8, "perplexity": 30, "seed": 0,
           "caption": "t-SNE"}
    out = tmp_path / "tsne.npz"
    compute_tsne(tiny_run_files["dataset"], "vit_mini", tiny_run_files["weights"], cfg, out, device="cpu", threads=1)
    data = read_tsne(out)
    assert data["blocks"] == [0, 3] and len(data["labels"]) == 32  # 4 classes x 8
    assert data["embeddings"][3].shape == (32, 2) and np.isfinite(data["embeddings"][3]).all()
    assert data["meta"]["label_kind"] == "fine"  # the synthetic set has no coarse labels
    fig = tsne_figure(data, dict(cfg, blocks=[0, 3, 5]))  # block 5 was not computed: said, not dropped
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles[:3] == ["after block 1 (index 0)", "after block 4 (index 3)", "after block 6 (index 5)"]
    assert "block index 5 (not in the probe's output)" in figure_notes(fig)
    with pytest.raises(ValueError, match="blocks"):
        compute_tsne(tiny_run_files["dataset"], "vit_mini", tiny_run_files["weights"], dict(cfg, blocks=[4]),
                     tmp_path / "bad.npz", device="cpu")
