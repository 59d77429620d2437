"""Label-skew schemes: which classes, and how many samples of each, every client holds.

  iid                   shuffled train pool, near-equal disjoint shards (FedHPL "IID" with min_per_class_frac)
  dirichlet             disjoint per-class Dirichlet label skew (PFLlib / FedHPL "Non-IID" and alpha sweep)
  classes_per_client    SGPT "noniid-labeluni" (sgpt.md 3.1), reproduced step by step
  pathological          FedPFT: n random classes per client, fixed samples per class
  dirichlet_per_client  FedPFT: per-client class mix q ~ Dir(alpha), exact totals, overlap allowed
"""
from __future__ import annotations

import math

import numpy as np

from fedcore.constraints import Violation
from fedcore.data.facts import DatasetFacts
from fedcore.partition.draw import (class_pools, cumulative_cut, gather, iid_shards, label_skew_test,
                                    largest_remainder, sample_class)
from fedcore.partition.registry import REQUIRED, Labels, register_scheme
from fedcore.partition.schemes.fedhpl import iid_with_minimum

LABEL_SKEW_TESTS = ("proportional", "iid", "full", "split")  # the test rules of iid and dirichlet


def _pool_limits(spec: dict, facts: DatasetFacts, dataset: str) -> list[Violation]:
    """iid and dirichlet: every client gets at least min_size train samples (dirichlet redraws until it does)."""
    train = facts.train
    if train.size is None:
        return []
    per_client = max(spec.get("min_size", 1), 1)
    most = train.size // per_client
    if spec["clients"] > most:
        need = f"at least {per_client} samples each (min_size)" if per_client > 1 else "at least one sample each"
        return [Violation("partition.clients", spec["clients"], f"1..{most}",
                          f"dataset {dataset} has {train.size} train samples, {need}")]
    return []


@register_scheme("iid", keys={"clients": REQUIRED, "min_per_class_frac": 0.0, "test": "proportional",
                              "test_fraction": 0.25},
                 test_modes=LABEL_SKEW_TESTS, limits=_pool_limits, omitted_at_default=("min_per_class_frac",))
def iid(spec: dict, labels: Labels, rng: np.random.Generator):
    """IID shards of the train pool (after FedHPL's per-class minimum, if any); the test rule of ``test``."""
    if spec.get("min_per_class_frac", 0.0) > 0:
        train = iid_with_minimum(spec, labels.train_y, rng)
    else:
        train = iid_shards(len(labels.train_y), spec["clients"], rng)
    return label_skew_test(spec, train, labels.train_y, labels.test_y, rng)


def _dirichlet_once(spec: dict, train_y: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """One draw of the disjoint per-class Dirichlet split (with per-class minimum and optional balancing)."""
    k, n = spec["clients"], len(train_y)
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    sizes = np.zeros(k, dtype=np.int64)
    for c in np.unique(train_y):
        pool = rng.permutation(np.flatnonzero(train_y == c))
        # FedHPL: every client first gets floor(frac * N_c) samples of every class
        m_c = int(math.floor(spec["min_per_class_frac"] * len(pool)))
        if m_c * k > len(pool):
            raise ValueError(
                f"min_per_class_frac={spec['min_per_class_frac']} asks {m_c} samples of class {c} for each of "
                f"{k} clients but the class has only {len(pool)}"
            )
        for i in range(k):
            parts[i].append(pool[i * m_c : (i + 1) * m_c])
        sizes += m_c
        rest = pool[m_c * k :]
        if spec["alpha"] == "random":
            u = rng.uniform(0, 1, k)
            a = u / u.sum()  # FedHPL "random alpha": alpha_{k,c} ~ U(0,1), normalised so sum_k = 1
        else:
            a = np.full(k, spec["alpha"])
        p = rng.dirichlet(a)
        if spec["balance"]:
            # PFLlib mask: clients already at or above the average size get no more of this class
            masked = p * (sizes < n / k)
            p = masked if masked.sum() > 0 else p
        for i, piece in enumerate(cumulative_cut(rest, p / p.sum())):
            parts[i].append(piece)
            sizes[i] += len(piece)
    return gather(parts)


def _dirichlet_redrawn(spec: dict, train_y: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Disjoint per-class Dirichlet split, redrawn until every client has >= min_size train samples."""
    smallest = -1
    for _ in range(spec["max_tries"]):
        parts = _dirichlet_once(spec, train_y, rng)
        smallest = min(len(p) for p in parts)
        if smallest >= spec["min_size"]:
            return parts
    raise ValueError(
        f"dirichlet partition: after max_tries={spec['max_tries']} draws some client still has fewer than "
        f"min_size={spec['min_size']} train samples (last draw's smallest client: {smallest}); "
        f"raise alpha, lower min_size or clients, or raise max_tries"
    )


@register_scheme("dirichlet", keys={"clients": REQUIRED, "alpha": REQUIRED, "min_size": 10, "max_tries": 100,
                                    "min_per_class_frac": 0.0, "balance": False, "test": "proportional",
                                    "test_fraction": 0.25},
                 test_modes=LABEL_SKEW_TESTS, limits=_pool_limits, random_alpha=True)
def dirichlet(spec: dict, labels: Labels, rng: np.random.Generator):
    """Disjoint per-class Dirichlet label skew; the test rule of ``test``."""
    train = _dirichlet_redrawn(spec, labels.train_y, rng)
    return label_skew_test(spec, train, labels.train_y, labels.test_y, rng)


def _classes_per_client_limits(spec: dict, facts: DatasetFacts, dataset: str) -> list[Violation]:
    """SGPT's scheme: clients * classes_per_client divisible by the class count, and no empty share."""
    m, s, k = spec["clients"], spec["classes_per_client"], facts.classes
    step = k // math.gcd(k, s)  # clients * s is a multiple of k iff clients is a multiple of step
    if m % step:
        return [Violation("partition.clients", m, f"multiples of {step}",
                          f"clients * classes_per_client ({s}) must be a multiple of the {k} classes of "
                          f"dataset {dataset}")]
    # Each class is dealt to n = s*m/k clients with shares a_j / sum(a), a ~ U(0.4, 0.6): the smallest share
    # of a class of N samples, int(N * 0.4 / (0.4 + 0.6 (n - 1))), is >= 1 for every draw iff
    # 3 (n - 1) <= 2 (N - 1).
    known = [(split.min_class, what) for what, split in (("train", facts.train), ("test", facts.test))
             if split.min_class is not None]
    if not known:
        return []
    n, what = min(known)
    sharers = 1 + 2 * (n - 1) // 3
    most = (sharers * k // s) // step * step
    if m > most:
        return [Violation("partition.clients", m, f"{step}..{most} in steps of {step}",
                          f"with classes_per_client {s}, each of the {k} classes of dataset {dataset} is shared by "
                          f"clients * {s} / {k} clients; beyond {sharers} the smallest class ({n} {what} samples) "
                          f"can leave a client's share empty")]
    return []



@register_scheme("classes_per_client", keys={"clients": REQUIRED, "classes_per_client": REQUIRED, "test": "proportional"},
                 test_modes=("proportional", "full"), limits=_classes_per_client_limits)
def classes_per_client(spec: dict, labels: Labels, rng: np.random.Generator):
    """SGPT 'noniid-labeluni' (sgpt.md 3.1), step by step; returns (train, test) index lists."""
    train_y, test_y = labels.train_y, labels.test_y
    m, s = spec["clients"], spec["classes_per_client"]
    classes = np.unique(train_y)
    k = len(classes)
    if s > k:
        raise ValueError(f"classes_per_client={s} exceeds the {k} classes in the train split")
    if (s * m) % k:
        raise ValueError(
            f"classes_per_client: count_per_class = classes_per_client*clients/num_classes = {s}*{m}/{k} "
            f"is not an integer; choose values with {k} dividing {s * m}"
        )
    count_per_class = s * m // k
    probs: list[list[float]] = []
    for _ in range(k):
        a = rng.uniform(0.4, 0.6, count_per_class)
        probs.append(list(a / a.sum()))
    remaining = np.full(k, count_per_class, dtype=np.int64)
    assignment: list[list[tuple[int, float]]] = []
    for _ in range(m):
        mine = []
        for _ in range(s):
            j = int(rng.choice(np.flatnonzero(remaining == remaining.max())))
            remaining[j] -= 1
            mine.append((j, probs[j].pop()))
        assignment.append(mine)
    train_pool = class_pools(train_y, classes, rng)
    test_pool = class_pools(test_y, classes, rng)
    n_train = {int(c): len(train_pool[int(c)]) for c in classes}  # generalises the code's 500 ...
    n_test = {int(c): len(test_pool[int(c)]) for c in classes}  # ... and 100 to the real pool sizes
    train: list[list[np.ndarray]] = [[] for _ in range(m)]
    test: list[list[np.ndarray]] = [[] for _ in range(m)]
    for i, mine in enumerate(assignment):
        for j, p in mine:
            c = int(classes[j])
            n_tr, n_te = int(n_train[c] * p), int(n_test[c] * p)
            train[i].append(train_pool[c][:n_tr])
            train_pool[c] = train_pool[c][n_tr:]
            test[i].append(test_pool[c][:n_te])
            test_pool[c] = test_pool[c][n_te:]
    return gather(train), gather(test)



def _pathological_limits(spec: dict, facts: DatasetFacts, dataset: str) -> list[Violation]:
    """FedPFT's pathological split: every class has the train and test samples a client takes of it."""
    out = []
    for key, split in (("train_per_class", facts.train), ("test_per_class", facts.test)):
        if split.min_class is not None and spec[key] > split.min_class:
            what = key.split("_")[0]
            out.append(Violation(f"partition.{key}", spec[key], f"0..{split.min_class}" if what == "test"
                                 else f"1..{split.min_class}",
                                 f"the smallest class of dataset {dataset} has {split.min_class} {what} samples"))
    return out


class _ClassStream:
    """Hands out disjoint chunks of one class pool; starts a fresh shuffle of it once it runs dry."""

    def __init__(self, pool: np.ndarray, rng: np.random.Generator) -> None:
        self.pool, self.rng = pool, rng
        self.left = rng.permutation(pool)

    def take(self, n: int) -> np.ndarray:
        if n > len(self.pool):
            raise ValueError(f"request of {n} exceeds class pool of {len(self.pool)}")
        if n > len(self.left):
            # pool exhausted: later clients may now share samples with earlier ones, never within a client
            self.left = self.rng.permutation(self.pool)
        out, self.left = self.left[:n], self.left[n:]
        return out


@register_scheme("pathological", keys={"clients": REQUIRED, "classes_per_client": REQUIRED, "train_per_class": REQUIRED,
                                       "test_per_class": REQUIRED, "test": "proportional"},
                 test_modes=("proportional", "full"), limits=_pathological_limits)
def pathological(spec: dict, labels: Labels, rng: np.random.Generator):
    """FedPFT: each client gets `classes_per_client` random classes, fixed train/test counts per class.

    Unlike Fling's pathological_sampling (FedPFT's group's framework), which samples every client independently
    (clients overlap from the start), a class's samples go to clients disjointly until its pool runs dry
    (DEVIATIONS.md, Partitions; tests/test_official_partitions.py)."""
    train_y, test_y = labels.train_y, labels.test_y
    m, s = spec["clients"], spec["classes_per_client"]
    classes = np.unique(train_y)
    if s > len(classes):
        raise ValueError(f"classes_per_client={s} exceeds the {len(classes)} classes in the train split")
    picks = [np.sort(rng.choice(classes, size=s, replace=False)) for _ in range(m)]
    streams = {}
    for split, y, key in (("train", train_y, "train_per_class"), ("test", test_y, "test_per_class")):
        for c in classes:
            pool = np.flatnonzero(y == c)
            if spec[key] > len(pool):
                raise ValueError(
                    f"pathological: {key}={spec[key]} exceeds the {len(pool)} {split} samples of class {int(c)}"
                )
            streams[split, int(c)] = _ClassStream(pool, rng)
    train = [[streams["train", int(c)].take(spec["train_per_class"]) for c in pick] for pick in picks]
    test = [[streams["test", int(c)].take(spec["test_per_class"]) for c in pick] for pick in picks]
    return gather(train), gather(test)



@register_scheme("dirichlet_per_client", keys={"clients": REQUIRED, "alpha": REQUIRED, "train_per_client": REQUIRED,
                                               "test_per_client": REQUIRED, "test": "proportional"},
                 test_modes=("proportional", "full"))
def dirichlet_per_client(spec: dict, labels: Labels, rng: np.random.Generator):
    """FedPFT: q_i ~ Dir(alpha 1_C) per client; exact totals; independent sampling across clients.

    Counts are largest-remainder shares of q_i (every class within 1 of total * q_ic); Fling's dirichlet_sampling
    rounds int(total * q_ic + 0.5) capped at what is left and gives the last class the rest, so its totals are exact
    too but its last class absorbs the rounding (DEVIATIONS.md, Partitions; tests/test_official_partitions.py)."""
    train_y, test_y = labels.train_y, labels.test_y
    classes = np.unique(train_y)
    train_pools = {int(c): np.flatnonzero(train_y == c) for c in classes}
    test_pools = {int(c): np.flatnonzero(test_y == c) for c in classes}
    train: list[list[np.ndarray]] = []
    test: list[list[np.ndarray]] = []
    for i in range(spec["clients"]):
        q = rng.dirichlet(np.full(len(classes), spec["alpha"]))
        n_tr = largest_remainder(q, spec["train_per_client"])
        n_te = largest_remainder(q, spec["test_per_client"])
        what = f"dirichlet_per_client client {i}"
        train.append([sample_class(train_pools[int(c)], int(n), rng, what) for c, n in zip(classes, n_tr)])
        test.append([sample_class(test_pools[int(c)], int(n), rng, what) for c, n in zip(classes, n_te)])
    return gather(train), gather(test)

