"""Scores of a clustering against labels or another clustering (SGPT Table 4 and Fig. 6a)."""
from __future__ import annotations

import numpy as np

from fedcore.metrics import contingency, hungarian_accuracy  # noqa: F401 - SGPT Table 4's score, with this module's


def query_l2(features: np.ndarray, relu: bool = False) -> np.ndarray:
    """SGPT's query transform: L2-normalise each row, after a ReLU with ``relu`` (the official code's), as float32."""
    x = np.asarray(features, dtype=np.float32)
    if relu:
        x = np.maximum(x, 0.0)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norm, 1e-12)  # F.normalize's eps: an all-zero row stays zero


def relu_l2(features: np.ndarray) -> np.ndarray:
    """The official code's query transform: ReLU, then L2-normalise each row (spec sgpt §1.4), as float32."""
    return query_l2(features, relu=True)


def overlap_accuracy(groups: np.ndarray, reference: np.ndarray) -> float:
    """Acc_overlap: the fraction of samples in their group's best-matching reference cluster.

    Rows of the contingency table are the groups (SGPT's), so the score is the sum of row maxima / N.
    Rows are the groups, not the reference clusters, because the other orientation gives a collapsed
    Select (every sample in one group) a perfect 1.0; this way a collapse scores the largest reference
    cluster's share, about 1/K.
    """
    if len(groups) == 0:
        return float("nan")
    return float(contingency(groups, reference).max(axis=1).sum() / len(groups))


def majority_fraction(labels: np.ndarray, clusters: np.ndarray) -> float:
    """Q_kmeans: per class, the fraction of its samples in its majority cluster, weighted by class size."""
    if len(labels) == 0:
        return float("nan")
    return float(contingency(labels, clusters).max(axis=1).sum() / len(labels))


def congruence(groups: np.ndarray, kmeans: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """SGPT's congruence score (App. D.2, spec §3.5): Acc_overlap(groups vs K-Means) / Q_kmeans(labels)."""
    acc = overlap_accuracy(groups, kmeans)
    q = majority_fraction(labels, kmeans)
    return {"acc_overlap": acc, "q_kmeans": q, "congruence": acc / q if q > 0 else float("nan")}


def kmeans_clusters(features: np.ndarray, k: int, seed: int, n_init: int = 10) -> np.ndarray:
    """Cluster ids of scikit-learn K-Means (k-means++, `n_init` restarts, fixed seed) on `features`."""
    from sklearn.cluster import KMeans

    if not 1 <= k <= len(features):
        raise ValueError(f"K-Means needs 1 <= k <= {len(features)} samples, got k={k}")
    return KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit_predict(features).astype(np.int64)
