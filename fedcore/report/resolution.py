"""The resolution of a table's numbers: how many test images stand behind each cell, the binomial interval of a
single-seed accuracy, and columns whose numbers cannot tell the methods apart.

A cell's accuracy is a proportion of correctly classified test images (or a mean of such proportions over
clients, or over the rounds of a report window, which re-use the same images and so add none). Its resolution
is one image: 100 / n points. For a single seed the table gives the Wilson score interval at 95 % of that
proportion with n images (Wilson 1927; it stays inside [0, 100] and is sensible at 0 and 100 %, unlike the
normal approximation); several seeds give mean ± std over seeds instead. Which n a metric uses:

    global_acc, global_acc_min/max      the global test set (the union of the clients' local test sets without
                                        repeats, or the dataset's official test split)
    select_cluster_acc                  the dataset's whole test split (SGPT Table 4 scores every test image)
    local_acc                           the sum of the clients' local test sets (a mean of client accuracies:
                                        exact for equal client sets, an approximation otherwise)
    worst_local_acc                     the smallest client's local test set (the worst client is one client;
                                        the smallest set gives the widest interval, so the interval is not
                                        narrower than the truth)
    client_acc                          that client's set, or the sum over the column's ``clients``
    upload counts, losses               none: not a proportion of test images

The sizes come from the run's partition file (``eval_sizes``), read for the first seed.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fedcore.partition.file import Partition

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
WILSON = "Wilson 95 %"
SEED_STD = "mean ± std over seeds"
NOT_A_PROPORTION = "none: not a proportion of test images"
ALL_ZERO, ALL_EQUAL = "all 0", "all equal"

RESOLUTION_COLUMNS = ["test_images", "test_images_of", "step", "ci95_low", "ci95_high", "interval", "degenerate"]

# metric -> which test set its n counts (module docstring)
_GLOBAL = {"global_acc", "global_acc_min", "global_acc_max"}
_TEST_SPLIT = {"select_cluster_acc"}


@dataclass(frozen=True)
class EvalSizes:
    """Test images per client (local test sets) and of the global test set (None: not known, or none)."""

    clients: tuple[int, ...]
    global_set: int | None
    test_split: int | None = None   # the dataset's whole test split


def wilson_interval(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``p`` (0..1) observed on ``n`` trials."""
    if n <= 0 or math.isnan(p):
        return math.nan, math.nan
    p = min(max(p, 0.0), 1.0)
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def eval_sizes(partition_path: str | os.PathLike, global_test: str, official_size: int | None) -> EvalSizes:
    """The test sizes of a run from its partition file; ``global_test`` official_test takes ``official_size``
    (the dataset's test split), pooled_local the union of the clients' test indices, none no global set
    (None); ``official_size`` is also the whole test split's size."""
    part = Partition.load(partition_path)
    clients = tuple(len(t) for t in part.test)
    if global_test == "official_test":
        return EvalSizes(clients, official_size, official_size)
    if global_test == "none":   # no global test set (its metrics are never read: fedcore/config/reports.py)
        return EvalSizes(clients, None, official_size)
    pooled = np.unique(np.concatenate(part.test)) if part.test else np.empty(0)
    return EvalSizes(clients, int(len(pooled)), official_size)


def cell_test_images(metric: str, client: int, clients: list[int] | None, sizes: EvalSizes | None
                     ) -> tuple[int | None, str]:
    """(n, what n counts) for a cell of ``metric`` (client -1 = aggregate; ``clients`` of a mean-over-clients
    column); (None, reason) when the cell is no proportion of test images or the sizes are unknown."""
    if metric not in _GLOBAL | _TEST_SPLIT and metric not in ("local_acc", "worst_local_acc", "client_acc"):
        return None, NOT_A_PROPORTION
    if sizes is None:
        return None, "test set size not known (no partition file read)"
    if metric in _TEST_SPLIT:
        if sizes.test_split is None:
            return None, "test split size not known before the data is built"
        return sizes.test_split, "whole test split"
    if metric in _GLOBAL:
        if sizes.global_set is None:
            return None, "global test set size not known before the data is built"
        return sizes.global_set, "global test set"
    if not sizes.clients:
        return None, "no client test sets"
    if metric == "local_acc":
        return sum(sizes.clients), "all clients' test sets (mean of client accuracies)"
    if metric == "worst_local_acc":
        return min(sizes.clients), "smallest client test set"
    wanted = clients or [client]
    if any(not 0 <= c < len(sizes.clients) for c in wanted):
        return None, f"client {max(wanted)} is not in the partition"
    if clients:
        return sum(sizes.clients[c] for c in clients), f"clients {clients[0]}-{clients[-1]}'s test sets"
    return sizes.clients[client], f"client {client}'s test set"


def resolution_columns(table: pd.DataFrame, cell_sizes: list[tuple[int | None, str]], decimals: int = 2
                       ) -> pd.DataFrame:
    """The table with RESOLUTION_COLUMNS, from each cell's (n, what n counts) in ``cell_sizes`` (table order):
    one image in points, the Wilson interval of a single-seed proportion (in %), how the cell's spread is given,
    and the column's degeneracy flag."""
    out = table.copy()
    rows = []
    for (idx, cell), (n, what) in zip(table.iterrows(), cell_sizes, strict=True):
        lo = hi = math.nan
        if cell["status"] != "ok" or math.isnan(cell["ours"]):
            interval = ""
        elif n is None:
            interval = what if what == NOT_A_PROPORTION else "none: " + what
        elif cell["n_seeds"] > 1:
            interval = SEED_STD
        else:
            lo, hi = (100.0 * v for v in wilson_interval(cell["ours"] / 100.0, n))
            interval = WILSON
        rows.append({"test_images": n, "test_images_of": what, "step": 100.0 / n if n else math.nan,
                     "ci95_low": lo, "ci95_high": hi, "interval": interval})
    extra = pd.DataFrame(rows, index=table.index, columns=RESOLUTION_COLUMNS[:-1])
    for col in RESOLUTION_COLUMNS[:-1]:
        out[col] = extra[col]
    out["test_images"] = out["test_images"].astype("Int64")
    out["step"] = out["step"].astype(float)
    out["ci95_low"], out["ci95_high"] = out["ci95_low"].astype(float), out["ci95_high"].astype(float)
    out["degenerate"] = degenerate_flags(table, decimals)
    return out


def degenerate_flags(table: pd.DataFrame, decimals: int = 2) -> pd.Series:
    """Per cell, its column's flag, from the numbers as shown: 'all 0' when every one is 0, 'all equal' when at
    least two are and all are equal, 'k of n equal (v)' when at least 4 numbers and 3 in 4 of them share one
    value (SGPT's Five-dataset worst local at mini: 8 of 9 at 0.00), else ''."""
    flags = pd.Series("", index=table.index, dtype=object)
    ok = (table["status"] == "ok") & table["ours"].notna()
    for _, idx in table.groupby("col_index").groups.items():
        shown = table.loc[idx].loc[ok.loc[idx], "ours"].round(decimals)
        if len(shown) == 0:
            continue
        counts = shown.value_counts()
        value, top = float(counts.index[0]), int(counts.iloc[0])
        if top == len(shown) and value == 0:
            flags.loc[idx] = ALL_ZERO
        elif top == len(shown) and top > 1:
            flags.loc[idx] = ALL_EQUAL
        elif len(shown) >= 4 and 4 * top >= 3 * len(shown):
            flags.loc[idx] = f"{top} of {len(shown)} equal ({value:.{decimals}f})"
    return flags


EXACT = "none: an exact count, not an estimate from test images"


def exact_resolution(frame: pd.DataFrame) -> pd.DataFrame:
    """A table of exact counts (parameters, dataset sizes) with RESOLUTION_COLUMNS saying it has no sampling error,
    so every table CSV carries the same columns."""
    out = frame.copy()
    out["test_images"] = pd.Series(pd.NA, index=out.index, dtype="Int64")
    out["test_images_of"] = EXACT
    out["step"] = out["ci95_low"] = out["ci95_high"] = math.nan
    out["interval"] = EXACT
    out["degenerate"] = ""
    return out
