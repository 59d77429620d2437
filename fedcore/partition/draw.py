"""What the partition schemes share: class pools, integer shares, cuts, the test-side rules of the label-skew schemes
(``test``: proportional, iid, full, split) and ``keep_fraction``'s stratified share. Every draw takes the rng it is
handed, so the same inputs always give the same indices."""
from __future__ import annotations

import math

import numpy as np


def class_pools(y: np.ndarray, classes: np.ndarray, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Shuffled indices of every class, in class order (one rng draw per class)."""
    return {int(c): rng.permutation(np.flatnonzero(y == c)) for c in classes}


def largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts proportional to `weights` that sum exactly to `total`."""
    w = np.asarray(weights, dtype=np.float64)
    if total == 0 or w.sum() <= 0:
        return np.zeros(len(w), dtype=np.int64)
    raw = w / w.sum() * total
    counts = np.floor(raw).astype(np.int64)
    short = total - int(counts.sum())
    # stable sort so ties go to the lower class index, deterministically
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[:short]] += 1
    return counts


def cumulative_cut(pool: np.ndarray, weights: np.ndarray) -> list[np.ndarray]:
    """Split all of `pool` into len(weights) pieces with sizes ~ weights (floor of cumulative shares)."""
    w = np.asarray(weights)
    if np.issubdtype(w.dtype, np.integer):
        # exact integer arithmetic: the last cut lands on len(pool) with no float error
        bounds = np.cumsum(w) * len(pool) // max(int(w.sum()), 1)
    else:
        bounds = (np.cumsum(w / w.sum()) * len(pool)).astype(np.int64)
    return np.split(pool, bounds[:-1])


def gather(lists: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Each client's pieces concatenated into one int64 index array (empty when it has none)."""
    return [np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64) for parts in lists]


def check_labels(name: str, y: np.ndarray) -> np.ndarray:
    """``y`` as int64 labels, or a ValueError if it is not a 1-D array of non-negative integers."""
    y = np.asarray(y)
    if y.ndim != 1 or (len(y) and not np.issubdtype(y.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got dtype {y.dtype} shape {y.shape}")
    if len(y) and y.min() < 0:
        raise ValueError(f"{name} has negative labels")
    return y.astype(np.int64)


def iid_shards(n: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle range(n) and cut it into k near-equal disjoint shards."""
    return [s.astype(np.int64) for s in np.array_split(rng.permutation(n), k)]


def sample_class(pool: np.ndarray, n: int, rng: np.random.Generator, what: str) -> np.ndarray:
    """n samples of one class pool, without replacement unless the pool is smaller than n."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if len(pool) == 0:
        raise ValueError(f"{what}: needs {n} samples of a class that has none")
    return rng.choice(pool, size=n, replace=n > len(pool))


def proportional_test(train: list[np.ndarray], train_y: np.ndarray, test_y: np.ndarray, rng: np.random.Generator):
    """Split every class's test pool disjointly over clients in proportion to their train counts of it."""
    classes = np.unique(train_y)
    counts = np.stack([np.bincount(train_y[t], minlength=int(classes.max()) + 1)[classes] for t in train])
    parts: list[list[np.ndarray]] = [[] for _ in train]
    for j, c in enumerate(classes):
        pool = rng.permutation(np.flatnonzero(test_y == c))
        if counts[:, j].sum() == 0 or len(pool) == 0:
            continue
        for i, piece in enumerate(cumulative_cut(pool, counts[:, j])):
            parts[i].append(piece)
    return gather(parts)


def split_from_train(train: list[np.ndarray], train_y: np.ndarray, frac: float, rng: np.random.Generator):
    """Carve a stratified `frac` of every client's own train samples out as its test set."""
    new_train, new_test = [], []
    for idx in train:
        idx = rng.permutation(idx)
        classes, sizes = np.unique(train_y[idx], return_counts=True)
        n_test = int(round(frac * len(idx)))
        per_class = largest_remainder(sizes, n_test) if len(idx) else np.zeros(0, dtype=np.int64)
        tr, te = [], []
        for c, n in zip(classes, per_class):
            members = idx[train_y[idx] == c]
            te.append(members[:n])
            tr.append(members[n:])
        new_train.append(np.sort(np.concatenate(tr)) if tr else np.zeros(0, dtype=np.int64))
        new_test.append(np.sort(np.concatenate(te)) if te else np.zeros(0, dtype=np.int64))
    return new_train, new_test


def label_skew_test(spec: dict, train, train_y, test_y, rng):
    """Apply the `test` rule of the iid / dirichlet / dirichlet_overlap schemes; returns (train, test)."""
    mode, k = spec["test"], len(train)
    if mode == "proportional":
        return train, proportional_test(train, train_y, test_y, rng)
    if mode == "iid":
        return train, iid_shards(len(test_y), k, rng)
    if mode == "full":
        return train, [np.arange(len(test_y), dtype=np.int64) for _ in range(k)]
    return split_from_train(train, train_y, spec["test_fraction"], rng)


def keep_share(train: list[np.ndarray], train_y: np.ndarray, fraction: float,
               rng: np.random.Generator) -> list[np.ndarray]:
    """Each client's train indices cut to a class-stratified share: round(fraction * n_c) of its n_c samples of
    every class c, a seeded random subset, in the client's own order.

    Stratified, so that the share changes how much data a client has and not its label mix; rounded per
    class (half up), so that a larger fraction keeps a superset: every class is one fixed random order of the
    client's samples cut at a longer prefix, and the rng draws the same orders whatever the fraction.
    """
    out = []
    for i, idx in enumerate(train):
        labels = train_y[idx]
        keep = np.zeros(len(idx), dtype=bool)
        for c in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == c))
            keep[members[: int(math.floor(fraction * len(members) + 0.5))]] = True
        if len(idx) and not keep.any():
            raise ValueError(f"keep_fraction={fraction} leaves client {i} without train samples (it holds "
                             f"{len(idx)}, at most {int(np.bincount(labels).max())} of one class); raise "
                             f"keep_fraction")
        out.append(idx[keep])
    return out
