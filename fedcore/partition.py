"""Federated partitions: which train/test samples each client holds.

A partition is a pure function of (validated spec, seed, labels[, domains]). All randomness comes
from one `np.random.default_rng(seed)` threaded through the helpers, so the same inputs always give
identical index arrays, and every method of an experiment trains on the same client data.

Schemes (see SCHEMES for keys and defaults):
  iid                   shuffled train pool, near-equal disjoint shards (FedHPL "IID" with min_per_class_frac)
  dirichlet             disjoint per-class Dirichlet label skew (PFLlib / FedHPL "Non-IID" and alpha sweep)
  dirichlet_overlap     FedHPL "Dir": per-client class mix, clients sample independently (overlap)
  class_subsets         FedHPL C.3: the baselines' own protocol, 80/20 per class and class subsets per client
  dirichlet_per_client  FedPFT: per-client class mix q ~ Dir(alpha), exact totals, overlap allowed
  classes_per_client    SGPT "noniid-labeluni" (sgpt.md 3.1), reproduced step by step
  pathological          FedPFT: n random classes per client, fixed samples per class
  domain                one or more IID clients per domain (Office, DomainNet, Five-dataset)

Every scheme also takes ``keep_fraction`` (COMMON_KEYS): each client then trains on a seeded, class-stratified
share of the train samples the scheme gave it (FedHPL Fig. 3(b)); its test set stays the full partition's.

The FedHPL algorithms live in fedcore.partition_fedhpl; this module keeps the table, validation and format.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from fedcore.constraints import Violation
from fedcore.data.facts import DatasetFacts
from fedcore.io import atomic_path, read_npz

REQUIRED = "<required>"  # marker in SCHEMES for keys without a default (a string so SCHEMES stays JSON-able)

# The local-test rules each scheme accepts under the `test` key; the first one is the default.
TEST_MODES: dict[str, tuple[str, ...]] = {
    "iid": ("proportional", "iid", "full", "split"),
    "dirichlet": ("proportional", "iid", "full", "split"),
    "dirichlet_per_client": ("proportional", "full"),
    "classes_per_client": ("proportional", "full"),
    "pathological": ("proportional", "full"),
    "domain": ("domain", "full"),
    "dirichlet_overlap": ("full", "proportional", "iid"),  # no "split": a shared sample would leak into a test set
    "class_subsets": ("split",),  # the private 20 % test pool of the clients' own classes
}

SCHEMES: dict[str, dict[str, Any]] = {
    "iid": {"clients": REQUIRED, "min_per_class_frac": 0.0, "test": "proportional", "test_fraction": 0.25},
    "dirichlet": {
        "clients": REQUIRED,
        "alpha": REQUIRED,
        "min_size": 10,
        "max_tries": 100,
        "min_per_class_frac": 0.0,
        "balance": False,
        "test": "proportional",
        "test_fraction": 0.25,
    },
    "dirichlet_per_client": {
        "clients": REQUIRED,
        "alpha": REQUIRED,
        "train_per_client": REQUIRED,
        "test_per_client": REQUIRED,
        "test": "proportional",
    },
    "classes_per_client": {"clients": REQUIRED, "classes_per_client": REQUIRED, "test": "proportional"},
    "pathological": {
        "clients": REQUIRED,
        "classes_per_client": REQUIRED,
        "train_per_class": REQUIRED,
        "test_per_class": REQUIRED,
        "test": "proportional",
    },
    "domain": {
        "clients_per_domain": 1,
        "train_fraction_of_min": None,
        "equal_test_size": False,
        "test": "domain",
    },
    "dirichlet_overlap": {
        "clients": REQUIRED,
        "alpha": REQUIRED,
        "alpha_sum": None,  # with alpha: random, 'classes' (CIFAR-10) or 'clients' (CIFAR-100, SVHN)
        "min_per_class_frac": 0.0,
        "test": "full",
    },
    "class_subsets": {
        "clients": REQUIRED,
        "classes_per_client": REQUIRED,  # a list, one class count per client: [2, 4, 6, 8, 10]
        "setting": REQUIRED,  # iid | dirichlet | dirichlet_overlap inside the clients' classes
        "alpha": None,
        "alpha_sum": None,
        "min_per_class_frac": 0.0,
        "test": "split",
        "test_fraction": 0.2,
    },
}

# Keys every scheme takes, applied after the scheme's own draw (see keep_share).
COMMON_KEYS: dict[str, Any] = {"keep_fraction": 1.0}

# Keys added to a scheme after its partitions were in use: left out of the validated spec while they hold
# their default, so that the ids and files of the earlier specs stay byte-identical.
_OMITTED_AT_DEFAULT: dict[str, dict[str, Any]] = {
    **{scheme: dict(COMMON_KEYS) for scheme in SCHEMES},
    "iid": {"min_per_class_frac": 0.0, **COMMON_KEYS},
}

SETTINGS = ("iid", "dirichlet", "dirichlet_overlap")  # class_subsets' settings inside the class subsets
ALPHA_SUMS = ("classes", "clients")

# Derived keys that validate_spec adds itself; accepted on input only with the derived value,
# so validate_spec(validate_spec(s)) == validate_spec(s).
_DERIVED = ("test_from",)


# --------------------------------------------------------------------------------------------
# Partition container
# --------------------------------------------------------------------------------------------


@dataclass
class Partition:
    """Per-client index arrays into the dataset's splits, plus the spec and seed that made them."""

    train: list[np.ndarray]
    test: list[np.ndarray]
    spec: dict
    seed: int

    def __post_init__(self) -> None:
        self.train = [np.asarray(a, dtype=np.int64) for a in self.train]
        self.test = [np.asarray(a, dtype=np.int64) for a in self.test]
        if len(self.train) != len(self.test):
            raise ValueError(f"{len(self.train)} train lists but {len(self.test)} test lists")
        self.seed = int(self.seed)

    @property
    def num_clients(self) -> int:
        """Number of clients."""
        return len(self.train)

    @property
    def test_from(self) -> str:
        """Which split the test indices index: 'test' (usual) or 'train' (test: split)."""
        return self.spec.get("test_from", "test")

    def save(self, path: str | Path) -> None:
        """Write the partition to one .npz (concatenated indices + offsets + spec json + seed), atomically."""
        arrays = {
            "format": np.array([_FORMAT_VERSION], dtype=np.int64),
            "train_idx": _concat(self.train),
            "train_offsets": _offsets(self.train),
            "test_idx": _concat(self.test),
            "test_offsets": _offsets(self.test),
            "spec_json": np.frombuffer(_canonical_json(self.spec).encode(), dtype=np.uint8),
            "seed": np.array([self.seed], dtype=np.int64),
        }
        with atomic_path(path, suffix=".npz") as tmp:
            with open(tmp, "wb") as fh:  # a file handle stops numpy from appending a second ".npz"
                np.savez(fh, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> "Partition":
        """Read a partition written by save(), with a clear error if missing, unreadable or not a partition."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"partition file {path} does not exist; build it with the pipeline's partition rule")
        z = read_npz(path, "partition")
        missing = sorted(set(_NPZ_KEYS) - set(z))
        if missing:
            raise ValueError(f"{path} is not a fedcore partition file (missing arrays {missing}; has {sorted(z)})")
        spec = json.loads(bytes(z["spec_json"]).decode())
        return cls(
            train=_split_offsets(z["train_idx"], z["train_offsets"]),
            test=_split_offsets(z["test_idx"], z["test_offsets"]),
            spec=spec,
            seed=int(z["seed"][0]),
        )


_FORMAT_VERSION = 1
_NPZ_KEYS = ("format", "train_idx", "train_offsets", "test_idx", "test_offsets", "spec_json", "seed")


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _offsets(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)


def _split_offsets(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [flat[offsets[i] : offsets[i + 1]].copy() for i in range(len(offsets) - 1)]


# --------------------------------------------------------------------------------------------
# Spec validation and ids
# --------------------------------------------------------------------------------------------


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _check_int(key: str, v: Any, lo: int) -> int:
    if not _is_int(v) or v < lo:
        raise ValueError(f"partition key {key!r} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _check_float(key: str, v: Any, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
    ok = _is_number(v) and math.isfinite(float(v))
    if ok:
        f = float(v)
        ok = (f > lo if lo_open else f >= lo) and (f < hi if hi_open else f <= hi)
    if not ok:
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"partition key {key!r} must be a number in {lb}{lo}, {hi}{rb}, got {v!r}")
    return float(v)


def _check_bool(key: str, v: Any) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"partition key {key!r} must be true or false, got {v!r}")
    return bool(v)


def _check_choice(key: str, v: Any, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise ValueError(f"partition key {key!r} must be one of {list(allowed)}, got {v!r}")
    return str(v)


def _check_class_list(key: str, v: Any) -> list[int]:
    if not isinstance(v, (list, tuple)) or not v or not all(_is_int(x) and x >= 1 for x in v):
        raise ValueError(f"partition key {key!r} must be a non-empty list of integers >= 1 (one per client), got {v!r}")
    return [int(x) for x in v]


def _check_alpha(key: str, v: Any, allow_random: bool) -> float | str:
    if allow_random and v == "random":
        return "random"
    if not _is_number(v) or not math.isfinite(float(v)) or float(v) <= 0:
        extra = ' or "random"' if allow_random else ""
        raise ValueError(f"partition key {key!r} must be a number > 0{extra}, got {v!r}")
    return float(v)


_RANDOM_ALPHA = ("dirichlet", "dirichlet_overlap", "class_subsets")  # schemes that accept alpha: random

# Per-key checks; each returns the normalised value (ints as int, numbers as float) so that
# equivalent specs (alpha: 1 vs alpha: 1.0) get the same partition_id.
_CHECKS: dict[str, Callable[[str, Any, str], Any]] = {
    "clients": lambda k, v, s: _check_int(k, v, 1),
    "alpha": lambda k, v, s: _check_alpha(k, v, allow_random=(s in _RANDOM_ALPHA)),
    "alpha_sum": lambda k, v, s: _check_choice(k, v, ALPHA_SUMS),
    "setting": lambda k, v, s: _check_choice(k, v, SETTINGS),
    "min_size": lambda k, v, s: _check_int(k, v, 0),
    "max_tries": lambda k, v, s: _check_int(k, v, 1),
    "min_per_class_frac": lambda k, v, s: _check_float(k, v, 0.0, 1.0, hi_open=True),
    "balance": lambda k, v, s: _check_bool(k, v),
    "test_fraction": lambda k, v, s: _check_float(k, v, 0.0, 1.0, lo_open=True, hi_open=True),
    "train_per_client": lambda k, v, s: _check_int(k, v, 1),
    "test_per_client": lambda k, v, s: _check_int(k, v, 0),
    "classes_per_client": lambda k, v, s: _check_class_list(k, v) if s == "class_subsets" else _check_int(k, v, 1),
    "train_per_class": lambda k, v, s: _check_int(k, v, 1),
    "test_per_class": lambda k, v, s: _check_int(k, v, 0),
    "clients_per_domain": lambda k, v, s: _check_int(k, v, 1),
    "train_fraction_of_min": lambda k, v, s: None if v is None else _check_float(k, v, 0.0, 1.0, lo_open=True),
    "equal_test_size": lambda k, v, s: _check_bool(k, v),
    "keep_fraction": lambda k, v, s: _check_float(k, v, 0.0, 1.0, lo_open=True),
}


def _check_test_mode(scheme: str, v: Any) -> str:
    allowed = TEST_MODES[scheme]
    if v not in allowed:
        raise ValueError(f"partition key 'test' for scheme {scheme!r} must be one of {list(allowed)}, got {v!r}")
    return str(v)


def validate_spec(spec: dict) -> dict:
    """Check a partition spec and return a new dict with defaults filled and values normalised."""
    if not isinstance(spec, dict):
        raise ValueError(f"partition spec must be a mapping, got {type(spec).__name__}")
    scheme = spec.get("scheme")
    if scheme not in SCHEMES:
        raise ValueError(f"partition key 'scheme' must be one of {sorted(SCHEMES)}, got {scheme!r}")
    allowed = {**SCHEMES[scheme], **COMMON_KEYS}
    unknown = sorted((k for k in spec if k != "scheme" and k not in allowed and k not in _DERIVED), key=str)
    if unknown:
        raise ValueError(
            f"unknown partition key {unknown[0]!r} for scheme {scheme!r}; allowed keys: {['scheme', *allowed]}"
        )
    out: dict[str, Any] = {"scheme": scheme}
    for key, default in allowed.items():
        if key not in spec:
            if default == REQUIRED:
                raise ValueError(f"partition scheme {scheme!r} needs key {key!r}; allowed keys: {['scheme', *allowed]}")
            out[key] = default
            continue
        value = spec[key]
        if value is None and default is None:  # an optional key given as null (as validate_spec writes it)
            out[key] = None
            continue
        out[key] = _check_test_mode(scheme, value) if key == "test" else _CHECKS[key](key, value, scheme)
    _check_combination(out)
    for key, default in _OMITTED_AT_DEFAULT.get(scheme, {}).items():
        if out[key] == default:
            del out[key]
    out["test_from"] = "train" if out["test"] == "split" else "test"
    if "test_from" in spec and spec["test_from"] != out["test_from"]:
        raise ValueError(
            f"partition key 'test_from' is derived from 'test' ({out['test']!r} -> {out['test_from']!r}); "
            f"got {spec['test_from']!r}"
        )
    return out


def _check_combination(out: dict) -> None:
    """Checks across keys of the FedHPL schemes: which alpha and alpha_sum a setting takes, one count per client."""
    scheme = out["scheme"]
    if scheme == "class_subsets":
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
    if scheme == "dirichlet_overlap" or out.get("setting") == "dirichlet_overlap":
        if out["alpha"] == "random" and out["alpha_sum"] is None:
            raise ValueError("partition key 'alpha_sum' is needed with alpha: random in FedHPL's overlapping "
                             "Dirichlet: 'classes' (sum over classes = 1, the paper's CIFAR-10) or 'clients' "
                             "(sum over clients = 1, CIFAR-100 and SVHN)")
        if out["alpha"] != "random" and out["alpha_sum"] is not None:
            raise ValueError(f"partition key 'alpha_sum' only applies to alpha: random, got alpha={out['alpha']}")
def num_clients(spec: dict, domains: int) -> int:
    """How many clients a validated spec makes (scheme domain: ``clients_per_domain`` per domain)."""
    return spec["clients_per_domain"] * domains if spec["scheme"] == "domain" else spec["clients"]


def spec_limits(spec: dict, facts: DatasetFacts, dataset: str) -> list[Violation]:
    """What a validated spec asks of the dataset that it cannot give (checked from its static facts, before
    any data is built): too many classes per client, too few samples for a client. Sizes that are not known
    statically (None in the facts) are not checked here; the partition rule checks them when it runs."""
    scheme, out = spec["scheme"], []
    train, test = facts.train, facts.test
    if scheme == "domain":
        return _domain_limits(spec, facts, dataset)
    # an int (SGPT's scheme) or one count per client (FedHPL's class_subsets)
    asked = spec.get("classes_per_client")
    most_asked = max(asked) if isinstance(asked, list) else asked
    if most_asked is not None and most_asked > facts.classes:
        out.append(Violation("partition.classes_per_client", asked, f"1..{facts.classes}"
                             + (" each" if isinstance(asked, list) else ""),
                             f"dataset {dataset} has {facts.classes} classes"))
        return out
    if scheme == "classes_per_client":
        out += _classes_per_client_limits(spec, facts, dataset)
    elif scheme == "pathological":
        for key, split in (("train_per_class", train), ("test_per_class", test)):
            if split.min_class is not None and spec[key] > split.min_class:
                what = key.split("_")[0]
                out.append(Violation(f"partition.{key}", spec[key], f"0..{split.min_class}" if what == "test"
                                     else f"1..{split.min_class}",
                                     f"the smallest class of dataset {dataset} has {split.min_class} {what} samples"))
    elif scheme in ("iid", "dirichlet") and train.size is not None:
        per_client = max(spec.get("min_size", 1), 1)  # dirichlet redraws until every client has min_size
        most = train.size // per_client
        if spec["clients"] > most:
            need = f"at least {per_client} samples each (min_size)" if per_client > 1 else "at least one sample each"
            out.append(Violation("partition.clients", spec["clients"], f"1..{most}",
                                 f"dataset {dataset} has {train.size} train samples, {need}"))
    return out


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


def _domain_limits(spec: dict, facts: DatasetFacts, dataset: str) -> list[Violation]:
    """Scheme domain: the dataset has domains, and every client's shard of the smallest domain is non-empty."""
    k = spec["clients_per_domain"]
    if facts.domains == 0:
        return [Violation("partition.scheme", "domain", "a scheme without domains",
                          f"dataset {dataset} has no domain labels")]
    for what, split in (("train", facts.train), ("test", facts.test)):
        n = split.min_domain
        if n is not None and k > n:
            return [Violation("partition.clients_per_domain", k, f"1..{n}",
                              f"the smallest domain of dataset {dataset} has {n} {what} samples")]
    f, n = spec["train_fraction_of_min"], facts.train.min_domain
    if f is not None and n is not None and int(f * (n // k)) < 1:
        least = 1 / (n // k)
        return [Violation("partition.train_fraction_of_min", f, f"[{least:.4g}, 1]",
                          f"every client keeps int(fraction * {n // k}) train samples: the smallest client of "
                          f"dataset {dataset} has {n // k} ({n} in its smallest domain / {k} clients per domain)")]
    return []


def partition_id(spec: dict) -> str:
    """Short stable id for file names: '<scheme>-<8 hex of sha1(canonical json of the validated spec)>'."""
    v = validate_spec(spec)
    return f"{v['scheme']}-{hashlib.sha1(_canonical_json(v).encode()).hexdigest()[:8]}"


# --------------------------------------------------------------------------------------------
# Small shared helpers
# --------------------------------------------------------------------------------------------


def _class_pools(y: np.ndarray, classes: np.ndarray, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Shuffled indices of every class, in class order (one rng draw per class)."""
    return {int(c): rng.permutation(np.flatnonzero(y == c)) for c in classes}


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
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


def _cumulative_cut(pool: np.ndarray, weights: np.ndarray) -> list[np.ndarray]:
    """Split all of `pool` into len(weights) pieces with sizes ~ weights (floor of cumulative shares)."""
    w = np.asarray(weights)
    if np.issubdtype(w.dtype, np.integer):
        # exact integer arithmetic: the last cut lands on len(pool) with no float error
        bounds = np.cumsum(w) * len(pool) // max(int(w.sum()), 1)
    else:
        bounds = (np.cumsum(w / w.sum()) * len(pool)).astype(np.int64)
    return np.split(pool, bounds[:-1])


def _gather(lists: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64) for parts in lists]


def _check_labels(name: str, y: np.ndarray) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or (len(y) and not np.issubdtype(y.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got dtype {y.dtype} shape {y.shape}")
    if len(y) and y.min() < 0:
        raise ValueError(f"{name} has negative labels")
    return y.astype(np.int64)


# --------------------------------------------------------------------------------------------
# Train-side schemes
# --------------------------------------------------------------------------------------------


def _iid_shards(n: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle range(n) and cut it into k near-equal disjoint shards."""
    return [s.astype(np.int64) for s in np.array_split(rng.permutation(n), k)]


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
        for i, piece in enumerate(_cumulative_cut(rest, p / p.sum())):
            parts[i].append(piece)
            sizes[i] += len(piece)
    return _gather(parts)


def _dirichlet(spec: dict, train_y: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
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


def _classes_per_client(spec: dict, train_y: np.ndarray, test_y: np.ndarray, rng: np.random.Generator):
    """SGPT 'noniid-labeluni' (sgpt.md 3.1), step by step; returns (train, test) index lists."""
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
    train_pool = _class_pools(train_y, classes, rng)
    test_pool = _class_pools(test_y, classes, rng)
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
    return _gather(train), _gather(test)


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


def _pathological(spec: dict, train_y: np.ndarray, test_y: np.ndarray, rng: np.random.Generator):
    """FedPFT: each client gets `classes_per_client` random classes, fixed train/test counts per class."""
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
    return _gather(train), _gather(test)


def _sample_class(pool: np.ndarray, n: int, rng: np.random.Generator, what: str) -> np.ndarray:
    """n samples of one class pool, without replacement unless the pool is smaller than n."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if len(pool) == 0:
        raise ValueError(f"{what}: needs {n} samples of a class that has none")
    return rng.choice(pool, size=n, replace=n > len(pool))


def _dirichlet_per_client(spec: dict, train_y: np.ndarray, test_y: np.ndarray, rng: np.random.Generator):
    """FedPFT: q_i ~ Dir(alpha 1_C) per client; exact totals; independent sampling across clients."""
    classes = np.unique(train_y)
    train_pools = {int(c): np.flatnonzero(train_y == c) for c in classes}
    test_pools = {int(c): np.flatnonzero(test_y == c) for c in classes}
    train: list[list[np.ndarray]] = []
    test: list[list[np.ndarray]] = []
    for i in range(spec["clients"]):
        q = rng.dirichlet(np.full(len(classes), spec["alpha"]))
        n_tr = _largest_remainder(q, spec["train_per_client"])
        n_te = _largest_remainder(q, spec["test_per_client"])
        what = f"dirichlet_per_client client {i}"
        train.append([_sample_class(train_pools[int(c)], int(n), rng, what) for c, n in zip(classes, n_tr)])
        test.append([_sample_class(test_pools[int(c)], int(n), rng, what) for c, n in zip(classes, n_te)])
    return _gather(train), _gather(test)


def _domain(spec: dict, train_domain: np.ndarray, test_domain: np.ndarray, rng: np.random.Generator):
    """IID shards of every domain's train and test sets; client order = domain order, then shard."""
    k = spec["clients_per_domain"]
    domains = np.unique(train_domain)
    missing = sorted(set(np.unique(test_domain).tolist()) - set(domains.tolist()))
    if missing:
        raise ValueError(f"domain partition: test domains {missing} have no train samples")
    train, test = [], []
    in_file_order = spec["train_fraction_of_min"] is not None
    for d in domains:
        tr_pool = rng.permutation(np.flatnonzero(train_domain == d))
        te_pool = rng.permutation(np.flatnonzero(test_domain == d))
        if in_file_order:  # the SGPT code's subset is a prefix of the domain's pickle, not a random draw
            tr_pool = np.sort(tr_pool)  # the permutation still runs so that the test shards stay the same
        train += [s.astype(np.int64) for s in np.array_split(tr_pool, k)]
        test += [s.astype(np.int64) for s in np.array_split(te_pool, k)]
    if in_file_order:
        # Office 0.5 / DomainNet 0.05 rule: every client keeps the first int(f * smallest pool) samples
        n = int(spec["train_fraction_of_min"] * min(len(t) for t in train))
        train = [t[:n] for t in train]
    if min(len(t) for t in train) == 0:
        raise ValueError(
            f"domain partition leaves a client without train samples (clients_per_domain={k}, "
            f"train_fraction_of_min={spec['train_fraction_of_min']}, smallest domain {min(np.bincount(train_domain)[domains])})"
        )
    if spec["equal_test_size"]:
        n = min(len(t) for t in test)
        test = [t[:n] for t in test]  # the shards are already shuffled, so a prefix is a random subsample
    return train, test


# --------------------------------------------------------------------------------------------
# Test-side rules for the label-skew schemes
# --------------------------------------------------------------------------------------------


def _proportional_test(train: list[np.ndarray], train_y: np.ndarray, test_y: np.ndarray, rng: np.random.Generator):
    """Split every class's test pool disjointly over clients in proportion to their train counts of it."""
    classes = np.unique(train_y)
    counts = np.stack([np.bincount(train_y[t], minlength=int(classes.max()) + 1)[classes] for t in train])
    parts: list[list[np.ndarray]] = [[] for _ in train]
    for j, c in enumerate(classes):
        pool = rng.permutation(np.flatnonzero(test_y == c))
        if counts[:, j].sum() == 0 or len(pool) == 0:
            continue
        for i, piece in enumerate(_cumulative_cut(pool, counts[:, j])):
            parts[i].append(piece)
    return _gather(parts)


def _split_from_train(train: list[np.ndarray], train_y: np.ndarray, frac: float, rng: np.random.Generator):
    """Carve a stratified `frac` of every client's own train samples out as its test set."""
    new_train, new_test = [], []
    for idx in train:
        idx = rng.permutation(idx)
        classes, sizes = np.unique(train_y[idx], return_counts=True)
        n_test = int(round(frac * len(idx)))
        per_class = _largest_remainder(sizes, n_test) if len(idx) else np.zeros(0, dtype=np.int64)
        tr, te = [], []
        for c, n in zip(classes, per_class):
            members = idx[train_y[idx] == c]
            te.append(members[:n])
            tr.append(members[n:])
        new_train.append(np.sort(np.concatenate(tr)) if tr else np.zeros(0, dtype=np.int64))
        new_test.append(np.sort(np.concatenate(te)) if te else np.zeros(0, dtype=np.int64))
    return new_train, new_test


def _label_skew_test(spec: dict, train, train_y, test_y, rng):
    """Apply the `test` rule of the iid / dirichlet / dirichlet_overlap schemes; returns (train, test)."""
    mode, k = spec["test"], len(train)
    if mode == "proportional":
        return train, _proportional_test(train, train_y, test_y, rng)
    if mode == "iid":
        return train, _iid_shards(len(test_y), k, rng)
    if mode == "full":
        return train, [np.arange(len(test_y), dtype=np.int64) for _ in range(k)]
    return _split_from_train(train, train_y, spec["test_fraction"], rng)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def make_partition(
    spec: dict,
    seed: int,
    train_y: np.ndarray,
    test_y: np.ndarray,
    train_domain: np.ndarray | None = None,
    test_domain: np.ndarray | None = None,
) -> Partition:
    """Build the partition a spec describes, deterministically from `seed`."""
    spec = validate_spec(spec)
    train_y, test_y = _check_labels("train_y", train_y), _check_labels("test_y", test_y)
    rng = np.random.default_rng(seed)
    scheme = spec["scheme"]
    from fedcore import partition_fedhpl as fedhpl  # here, not at the top: it builds on this module's helpers

    if scheme == "domain":
        if train_domain is None or test_domain is None:
            raise ValueError("partition scheme 'domain' needs train_domain and test_domain arrays")
        train_domain = _check_labels("train_domain", train_domain)
        test_domain = _check_labels("test_domain", test_domain)
        if len(train_domain) != len(train_y) or len(test_domain) != len(test_y):
            raise ValueError("domain arrays must have one entry per sample of their split")
        train, test = _domain(spec, train_domain, test_domain, rng)
    elif scheme in ("iid", "dirichlet", "dirichlet_overlap"):
        if scheme == "iid" and spec.get("min_per_class_frac", 0.0) > 0:
            train = fedhpl.iid_with_minimum(spec, train_y, rng)
        elif scheme == "iid":
            train = _iid_shards(len(train_y), spec["clients"], rng)
        elif scheme == "dirichlet_overlap":
            train = fedhpl.dirichlet_overlap(spec, train_y, rng)
        else:
            train = _dirichlet(spec, train_y, rng)
        train, test = _label_skew_test(spec, train, train_y, test_y, rng)
    elif scheme == "class_subsets":
        train, test = fedhpl.class_subsets(spec, train_y, rng)
    else:
        maker = {
            "classes_per_client": _classes_per_client,
            "pathological": _pathological,
            "dirichlet_per_client": _dirichlet_per_client,
        }[scheme]
        train, test = maker(spec, train_y, test_y, rng)
    if spec["test"] == "full":
        test = [np.arange(len(test_y), dtype=np.int64) for _ in train]
    if spec.get("keep_fraction", 1.0) < 1.0:  # after every other draw: the full partition is unchanged
        train = keep_share(train, train_y, spec["keep_fraction"], rng)
    return Partition(train=train, test=test, spec=spec, seed=seed)


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


def class_counts(partition: Partition, train_y: np.ndarray, test_y: np.ndarray) -> pd.DataFrame:
    """Long-form per-client class counts: columns client, split ('train'|'test'), class, count (> 0 only)."""
    train_y, test_y = np.asarray(train_y), np.asarray(test_y)
    test_labels = train_y if partition.test_from == "train" else test_y
    rows = []
    for split, lists, y in (("train", partition.train, train_y), ("test", partition.test, test_labels)):
        for i, idx in enumerate(lists):
            classes, counts = np.unique(y[idx], return_counts=True)
            rows += [(i, split, int(c), int(n)) for c, n in zip(classes, counts)]
    df = pd.DataFrame(rows, columns=["client", "split", "class", "count"])
    return df.astype({"client": "int64", "split": "object", "class": "int64", "count": "int64"})
