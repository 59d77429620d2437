"""Scores of a clustering against labels or another clustering (SGPT Table 4 and Fig. 6a)."""
from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment


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
    table = contingency(pred, truth)
    rows, cols = linear_sum_assignment(-table)
    return float(table[rows, cols].sum() / len(pred))
