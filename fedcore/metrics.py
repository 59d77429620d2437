"""The long-form metrics schema shared by the engine (which writes it) and the report (which reads it), and the
clustering score behind a metric that is no plain accuracy (SGPT's select_cluster_acc)."""
from __future__ import annotations

import numpy as np

# The long-form metrics schema, in column order: (name, dtype). "str" = any pandas string dtype.
METRIC_SCHEMA: list[tuple[str, str]] = [
    ("paper", "str"),
    ("experiment", "str"),
    ("method", "str"),
    ("scale", "str"),
    ("dataset", "str"),
    ("seed", "int64"),
    ("round", "int64"),
    ("client", "int64"),
    ("split", "str"),
    ("metric", "str"),
    ("value", "float64"),
]
METRIC_COLUMNS: list[str] = [name for name, _ in METRIC_SCHEMA]
METRIC_DTYPES: dict[str, str] = dict(METRIC_SCHEMA)

# A round whose trained state held a NaN or an infinity (client -1, split "train", value: how many tensors);
# written by the engine (fedcore/engine/health.py), marked by the report on every number of the run.
DIVERGED = "diverged"


def contingency(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Counts table (max(a)+1, max(b)+1) of pairs (a_i, b_i)."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    table = np.zeros((int(a.max(initial=-1)) + 1, int(b.max(initial=-1)) + 1), dtype=np.int64)
    np.add.at(table, (a, b), 1)
    return table


def hungarian_accuracy(pred: np.ndarray, truth: np.ndarray) -> float:
    """Fraction of samples correct under the best one-to-one matching of clusters to labels (spec sgpt §3.5)."""
    if len(pred) == 0:
        return float("nan")
    from scipy.optimize import linear_sum_assignment  # here: scipy costs every other run its import time

    table = contingency(pred, truth)
    rows, cols = linear_sum_assignment(-table)
    return float(table[rows, cols].sum() / len(pred))
