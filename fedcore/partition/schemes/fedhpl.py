"""FedHPL's data settings (paper B.2, C.3, C.5.4; spec fedhpl §3.2) as partition algorithms.

fedcore/partition/ owns validation, the npz format and the one `make_partition` entry point; this module holds only
the FedHPL-specific draws, all from the rng it is handed:

  iid with min_per_class_frac   every client first takes floor(frac * N_c) of every class, the rest is IID
  dirichlet_overlap             FedHPL "Dir": per-client class mix q_k ~ Dir(alpha_k), |D_k,c| = q_k,c * |D_k|,
                                clients drawn independently, so samples may be shared
  class_subsets                 the baselines' own protocol (C.3): 80/20 per-class split of the train set,
                                client k holds classes_per_client[k] random classes, one setting inside them

FedHPL "Non-IID" (disjoint, random or fixed alpha, per-class minimum) is the `dirichlet` scheme itself (label_skew.py).
Choices where the paper is silent are listed in DEVIATIONS.md ("FedHPL partitions").
"""
from __future__ import annotations

import math

import numpy as np

from fedcore.partition.draw import cumulative_cut, gather, label_skew_test, largest_remainder
from fedcore.partition.registry import REQUIRED, Labels, register_scheme



def _check_random_alpha(out: dict) -> None:
    """FedHPL's overlapping Dirichlet: alpha_sum goes with alpha: random, and only with it."""
    if out["alpha"] == "random" and out["alpha_sum"] is None:
        raise ValueError("partition key 'alpha_sum' is needed with alpha: random in FedHPL's overlapping "
                         "Dirichlet: 'classes' (sum over classes = 1, the paper's CIFAR-10) or 'clients' "
                         "(sum over clients = 1, CIFAR-100 and SVHN)")
    if out["alpha"] != "random" and out["alpha_sum"] is not None:
        raise ValueError(f"partition key 'alpha_sum' only applies to alpha: random, got alpha={out['alpha']}")


def _check_class_subsets(out: dict) -> None:
    """One class count per client; which alpha and alpha_sum a setting takes."""
    if len(out["classes_per_client"]) != out["clients"]:
        raise ValueError(f"partition key 'classes_per_client' must give one class count per client "
                         f"(clients={out['clients']}), got {out['classes_per_client']}")
    setting = out["setting"]
    if setting == "iid" and (out["alpha"] is not None or out["alpha_sum"] is not None):
        raise ValueError("partition keys 'alpha' and 'alpha_sum' do not apply to class_subsets with setting: iid")
    if setting != "iid" and out["alpha"] is None:
        raise ValueError(f"partition scheme 'class_subsets' with setting: {setting} needs key 'alpha' "
                         f"(a number > 0 or \"random\")")
    if setting == "dirichlet" and out["alpha_sum"] is not None:
        raise ValueError("partition key 'alpha_sum' does not apply to setting: dirichlet "
                         "(its random alpha always sums to 1 over the clients holding a class)")
    if setting == "dirichlet_overlap":
        _check_random_alpha(out)


def per_class_minimum(frac: float, class_size: int, holders: int, cls: int) -> int:
    """floor(frac * N_c), the samples of class `cls` every holder gets first; error if they cannot all get it."""
    m = int(math.floor(frac * class_size))
    if m * holders > class_size:
        raise ValueError(
            f"min_per_class_frac={frac} asks {m} samples of class {cls} for each of {holders} clients "
            f"but the class has only {class_size}"
        )
    return m


def random_alpha(rng: np.random.Generator, held: np.ndarray, alpha_sum: str) -> np.ndarray:
    """FedHPL's random alpha_{k,c} ~ U(0,1) on the held (client, class) cells, normalised per row or column.

    `held` is a clients x classes boolean mask. alpha_sum 'classes' makes every client's row sum to 1
    (the paper's CIFAR-10 "Dir"); 'clients' makes every class's column sum to 1 (CIFAR-100 and SVHN).
    """
    u = (1.0 - rng.uniform(size=held.shape)) * held  # 1 - U[0,1) lies in (0, 1]: never a zero concentration
    axis = 1 if alpha_sum == "classes" else 0
    total = u.sum(axis=axis, keepdims=True)
    return np.divide(u, total, out=np.zeros_like(u), where=total > 0)


def _fill(weights: np.ndarray, total: int, floor: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Integer counts with floor <= n <= cap summing to `total`, the part above the floor split by `weights`.

    A class that reaches its cap passes its surplus to the others in proportion to their weights (to all
    classes with room, equally, once the weighted ones are full), so a client's size is exactly `total`.
    """
    counts = floor.astype(np.int64).copy()
    left = total - int(counts.sum())  # callers keep floor.sum() <= total <= cap.sum(), so the loop ends
    while left > 0:
        room = cap - counts
        w = np.where(room > 0, weights, 0.0)
        if w.sum() <= 0:
            w = (room > 0).astype(np.float64)
        add = np.minimum(largest_remainder(w, left), room)
        counts += add
        left -= int(add.sum())
    return counts


def iid_with_minimum(spec: dict, train_y: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """IID shards after every client first takes floor(frac * N_c) samples of every class (all disjoint)."""
    k, frac = spec["clients"], spec["min_per_class_frac"]
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    rest = []
    for c in np.unique(train_y):
        pool = rng.permutation(np.flatnonzero(train_y == c))
        m = per_class_minimum(frac, len(pool), k, int(c))
        for i in range(k):
            parts[i].append(pool[i * m : (i + 1) * m])
        rest.append(pool[m * k :])
    shards = np.array_split(rng.permutation(np.concatenate(rest)), k)
    return [np.concatenate([*p, s]).astype(np.int64) for p, s in zip(parts, shards)]


def _overlap_counts(spec: dict, pool_sizes: np.ndarray, held: np.ndarray, budgets: np.ndarray,
                    rng: np.random.Generator) -> np.ndarray:
    """Clients x classes sample counts of FedHPL's "Dir": minimum first, the rest of |D_k| by q_k ~ Dir(alpha_k)."""
    k = held.shape[0]
    if spec["alpha"] == "random":
        alpha = random_alpha(rng, held, spec["alpha_sum"])
    else:
        alpha = np.where(held, spec["alpha"], 0.0)
    minimum = np.array([int(math.floor(spec["min_per_class_frac"] * n)) for n in pool_sizes], dtype=np.int64)
    counts = np.zeros(held.shape, dtype=np.int64)
    for i in range(k):
        cls = np.flatnonzero(held[i])
        q = rng.dirichlet(alpha[i, cls])
        floor, cap = minimum[cls], pool_sizes[cls]
        if floor.sum() > budgets[i]:
            raise ValueError(
                f"min_per_class_frac={spec['min_per_class_frac']} gives client {i} {int(floor.sum())} samples "
                f"before any draw, more than its share |D_k| = {int(budgets[i])}"
            )
        # a client whose classes hold fewer samples than its share takes all of them (class_subsets only)
        counts[i, cls] = _fill(q, min(int(budgets[i]), int(cap.sum())), floor, cap)
    return counts


@register_scheme("dirichlet_overlap", keys={"clients": REQUIRED, "alpha": REQUIRED,
                                            # with alpha: random, 'classes' (CIFAR-10) or 'clients' (CIFAR-100, SVHN)
                                            "alpha_sum": None, "min_per_class_frac": 0.0, "test": "full"},
                 # no "split": a shared sample would leak into a test set
                 test_modes=("full", "proportional", "iid"), check=_check_random_alpha, random_alpha=True)
def dirichlet_overlap(spec: dict, labels: Labels, rng: np.random.Generator):
    """FedHPL "Dir": |D_k| = N/K, |D_k,c| = q_k,c |D_k|; each client samples its classes independently (overlap);
    the test rule of ``test``."""
    train_y = labels.train_y
    classes = np.unique(train_y)
    pools = [np.flatnonzero(train_y == c) for c in classes]
    sizes = np.array([len(p) for p in pools], dtype=np.int64)
    held = np.ones((spec["clients"], len(classes)), dtype=bool)
    budgets = largest_remainder(np.ones(spec["clients"]), len(train_y))
    counts = _overlap_counts(spec, sizes, held, budgets, rng)
    return label_skew_test(spec, _sample_counts(pools, counts, rng), train_y, labels.test_y, rng)


def _sample_counts(pools: list[np.ndarray], counts: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Per client, counts[i, j] distinct samples of pool j; clients draw independently of each other."""
    return gather([[rng.permutation(pool)[:n] for pool, n in zip(pools, row) if n > 0] for row in counts])


def _disjoint_split(pool: np.ndarray, holders: np.ndarray, spec: dict, setting: str, minimum: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """One class's (shuffled) pool split disjointly over its holders: minimum first, then IID or Dirichlet."""
    h = len(holders)
    firsts = [pool[i * minimum : (i + 1) * minimum] for i in range(h)]
    rest = pool[minimum * h :]
    if setting == "iid":
        shares = np.array_split(rest, h)
    else:
        if spec["alpha"] == "random":
            u = 1.0 - rng.uniform(size=h)
            a = u / u.sum()  # sum over the class's holders = 1, as the paper's Non-IID setting
        else:
            a = np.full(h, spec["alpha"])
        shares = cumulative_cut(rest, rng.dirichlet(a))
    return [np.concatenate([f, s]).astype(np.int64) for f, s in zip(firsts, shares)]


@register_scheme("class_subsets", keys={"clients": REQUIRED,
                                        "classes_per_client": REQUIRED,  # a list, one class count per client
                                        "setting": REQUIRED,  # iid | dirichlet | dirichlet_overlap inside them
                                        "alpha": None, "alpha_sum": None, "min_per_class_frac": 0.0, "test": "split",
                                        "test_fraction": 0.2},
                 # the private 20 % test pool of the clients' own classes
                 test_modes=("split",), check=_check_class_subsets, random_alpha=True)
def class_subsets(spec: dict, labels: Labels, rng: np.random.Generator):
    """The baselines' original protocol (C.3): 80/20 per class, then class subsets; test indices index train.

    Returns (train, test) index lists into the train split.
    """
    train_y = labels.train_y
    k, setting = spec["clients"], spec["setting"]
    classes = np.unique(train_y)
    too_many = [s for s in spec["classes_per_client"] if s > len(classes)]
    if too_many:
        raise ValueError(f"classes_per_client {spec['classes_per_client']} asks for {max(too_many)} classes; "
                         f"the train split has {len(classes)}")
    picks = [np.sort(rng.choice(len(classes), size=s, replace=False)) for s in spec["classes_per_client"]]
    held = np.zeros((k, len(classes)), dtype=bool)
    for i, pick in enumerate(picks):
        held[i, pick] = True
    train_pools, test_pools = [], []
    for c in classes:
        pool = rng.permutation(np.flatnonzero(train_y == c))
        n_test = int(round(spec["test_fraction"] * len(pool)))
        test_pools.append(pool[:n_test])
        train_pools.append(pool[n_test:])
    sizes = np.array([len(p) for p in train_pools], dtype=np.int64)
    frac = spec["min_per_class_frac"]
    if setting == "dirichlet_overlap":
        budgets = largest_remainder(np.ones(k), int(sizes.sum()))
        counts = _overlap_counts(spec, sizes, held, budgets, rng)
        train = _sample_counts(train_pools, counts, rng)
        # the private test set mirrors the client's own class counts, scaled to the 20 % pool, drawn like its train
        test_counts = np.array([[int(round(n * len(te) / max(len(tr), 1))) for n, tr, te in
                                 zip(row, train_pools, test_pools)] for row in counts], dtype=np.int64)
        return train, _sample_counts(test_pools, test_counts, rng)
    train_parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    test_parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for j, c in enumerate(classes):
        holders = np.flatnonzero(held[:, j])
        if len(holders) == 0:
            continue  # a class no client holds stays unused
        minimum = per_class_minimum(frac, int(sizes[j]), len(holders), int(c))
        pieces = _disjoint_split(train_pools[j], holders, spec, setting, minimum, rng)
        # the class's test pool is cut over the same holders in proportion to their train counts (disjoint)
        weights = np.array([len(p) for p in pieces], dtype=np.int64)
        tests = cumulative_cut(test_pools[j], weights) if weights.sum() else [test_pools[j][:0]] * len(holders)
        for i, tr, te in zip(holders, pieces, tests):
            train_parts[i].append(tr)
            test_parts[i].append(te)
    return gather(train_parts), gather(test_parts)
