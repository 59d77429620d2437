"""SGPT Fig. 6a probe: congruence of each run's Select groups with a centralised K-Means reference.

K-Means (K = G, fixed seed) runs on the L2-normalised train Select queries (the cached ``features`` rule's
file), ReLU'd first for a run with ``query_relu`` (the official code's transform), once per transform; every
run's final keys then assign the same queries to groups with its own transform (Eq. 5, no calibration), and
congruence = Acc_overlap(groups, K-Means) / Q_kmeans(labels, K-Means) (spec §3.5).
Labels are the dataset's coarse labels (CIFAR-100's 20 superclasses), or its classes when it has none.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from fedcore.analysis.clustering import congruence, kmeans_clusters, query_l2
from fedcore.artifacts.select_queries import read_select_queries
from fedcore.data.arrays import load_bundle
from fedcore.io import atomic_path
from fedcore.methods.sgpt import select_groups

OK = "ok"
MISSING_RUN = "missing run"
NOT_CONFIGURED = "not configured"
NO_KEYS = "no keys in final.pt"

COLUMNS = ["value", "method", "seed", "status", "k", "labels", "acc_overlap", "q_kmeans", "congruence"]


def load_keys(final_path: str | os.PathLike) -> torch.Tensor | None:
    """A run's final global Select keys (G, D), or None when the run has none (e.g. no group prompts)."""
    final = torch.load(final_path, map_location="cpu", weights_only=True)
    keys = (final.get("global") or {}).get("keys")
    return None if keys is None else keys.float()


def reference_labels(dataset_path: str | os.PathLike) -> tuple[np.ndarray, str]:
    """Train labels to score K-Means against: coarse labels when the dataset has them, else classes."""
    train = load_bundle(dataset_path).train
    if train.coarse is not None:
        return np.asarray(train.coarse, dtype=np.int64), "coarse"
    return np.asarray(train.y, dtype=np.int64), "fine"


def congruence_table(train_queries: np.ndarray, labels: np.ndarray, label_kind: str, points: list[dict[str, Any]],
                     k: int, seed: int, n_init: int = 10) -> pd.DataFrame:
    """One row per (setting, run seed): congruence of that run's groups with K-Means, or why there is none.

    ``points``: dicts with value, method, seed, optionally ``query_relu`` (the run's method param; default false)
    and either ``path`` (the run's final.pt) or ``status``.
    """
    if len(train_queries) != len(labels):
        raise ValueError(f"{len(train_queries)} train queries but {len(labels)} labels")
    references: dict[bool, np.ndarray] = {}

    def clusters_for(relu: bool) -> np.ndarray:
        """K-Means on the queries as that run's Select sees them, computed once per transform."""
        if relu not in references:
            references[relu] = kmeans_clusters(query_l2(train_queries, relu), k, seed, n_init)
        return references[relu]

    queries = torch.from_numpy(np.ascontiguousarray(train_queries))
    rows = []
    for p in points:
        row = {"value": float(p["value"]), "method": p["method"], "seed": int(p.get("seed", 0)), "k": k,
               "labels": label_kind, "acc_overlap": math.nan, "q_kmeans": math.nan, "congruence": math.nan}
        path = p.get("path")
        if path is None:
            row["status"] = p.get("status", NOT_CONFIGURED)
        elif not Path(path).exists():
            row["status"] = MISSING_RUN
        else:
            keys = load_keys(path)
            if keys is None:
                row["status"] = NO_KEYS
            else:
                relu = bool(p.get("query_relu", False))
                groups = select_groups(queries, keys, relu).numpy()
                row.update(congruence(groups, clusters_for(relu), labels), status=OK)
        rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)


def write_congruence(queries_path: str | os.PathLike, dataset_path: str | os.PathLike, points: list[dict[str, Any]],
                     k: int, seed: int, out_csv: str | os.PathLike) -> pd.DataFrame:
    """Compute the congruence table from the cached Select queries and the runs' final.pt; write it as CSV."""
    train, _, _ = read_select_queries(queries_path)
    labels, kind = reference_labels(dataset_path)
    table = congruence_table(train, labels, kind, points, k, seed)
    with atomic_path(Path(out_csv)) as tmp:
        table.to_csv(tmp, index=False, float_format="%.6g")
    return table
