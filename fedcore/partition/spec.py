"""Partition specs: each key checked and normalised, defaults filled, a short stable id, and what a spec asks of a
dataset's static facts (before any data is built). The keys and rules of each scheme are its registration
(fedcore/partition/registry.py)."""
from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import numpy as np

from fedcore.constraints import Violation
from fedcore.data.facts import DatasetFacts
from fedcore.partition.file import canonical_json
from fedcore.partition.registry import REQUIRED, scheme, schemes

# Keys every scheme takes, applied after the scheme's own draw (see draw.keep_share).
COMMON_KEYS: dict[str, Any] = {"keep_fraction": 1.0, "fixed_seed": None, "bug_compat_classname_order": False}

SETTINGS = ("iid", "dirichlet", "dirichlet_overlap")  # class_subsets' settings inside the class subsets
ALPHA_SUMS = ("classes", "clients")

# Derived keys that validate_spec adds itself; accepted on input only with the derived value,
# so validate_spec(validate_spec(s)) == validate_spec(s).
_DERIVED = ("test_from",)

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


# Per-key checks; each returns the normalised value (ints as int, numbers as float) so that
# equivalent specs (alpha: 1 vs alpha: 1.0) get the same partition_id.
_CHECKS: dict[str, Callable[[str, Any, str], Any]] = {
    "clients": lambda k, v, s: _check_int(k, v, 1),
    "alpha": lambda k, v, s: _check_alpha(k, v, allow_random=scheme(s).random_alpha),
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
    "shots": lambda k, v, s: _check_int(k, v, 1),
    "fine_alpha": lambda k, v, s: _check_alpha(k, v, allow_random=False),
    "fixed_seed": lambda k, v, s: _check_int(k, v, 0),
    "bug_compat_classname_order": lambda k, v, s: _check_bool(k, v),
    "bug_compat_office_labels": lambda k, v, s: _check_bool(k, v),
}


def _check_test_mode(name: str, v: Any) -> str:
    allowed = scheme(name).test_modes
    if v not in allowed:
        raise ValueError(f"partition key 'test' for scheme {name!r} must be one of {list(allowed)}, got {v!r}")
    return str(v)



def validate_spec(spec: dict) -> dict:
    """Check a partition spec and return a new dict with defaults filled and values normalised."""
    if not isinstance(spec, dict):
        raise ValueError(f"partition spec must be a mapping, got {type(spec).__name__}")
    name = spec.get("scheme")
    if name not in schemes():
        raise ValueError(f"partition key 'scheme' must be one of {sorted(schemes())}, got {name!r}")
    entry = scheme(name)
    allowed = {**entry.keys, **COMMON_KEYS}
    unknown = sorted((k for k in spec if k != "scheme" and k not in allowed and k not in _DERIVED), key=str)
    if unknown:
        raise ValueError(
            f"unknown partition key {unknown[0]!r} for scheme {name!r}; allowed keys: {['scheme', *allowed]}"
        )
    out: dict[str, Any] = {"scheme": name}
    for key, default in allowed.items():
        if key not in spec:
            if default == REQUIRED:
                raise ValueError(f"partition scheme {name!r} needs key {key!r}; allowed keys: {['scheme', *allowed]}")
            out[key] = default
            continue
        value = spec[key]
        if value is None and default is None:  # an optional key given as null (as validate_spec writes it)
            out[key] = None
            continue
        out[key] = _check_test_mode(name, value) if key == "test" else _CHECKS[key](key, value, name)
    if entry.check is not None:
        entry.check(out)
    for key in (*entry.omitted_at_default, *COMMON_KEYS):
        if out[key] == allowed[key]:
            del out[key]
    out["test_from"] = "train" if out["test"] == "split" else "test"
    if "test_from" in spec and spec["test_from"] != out["test_from"]:
        raise ValueError(
            f"partition key 'test_from' is derived from 'test' ({out['test']!r} -> {out['test_from']!r}); "
            f"got {spec['test_from']!r}"
        )
    return out


def num_clients(spec: dict, domains: int) -> int:
    """How many clients a validated spec makes (scheme domain: ``clients_per_domain`` per domain)."""
    return spec["clients_per_domain"] * domains if spec["scheme"] == "domain" else spec["clients"]



def spec_limits(spec: dict, facts: DatasetFacts, dataset: str) -> list[Violation]:
    """What a validated spec asks of the dataset that it cannot give (checked from its static facts, before
    any data is built): too many classes per client, too few samples for a client. Sizes that are not known
    statically (None in the facts) are not checked here; the partition rule checks them when it runs."""
    # an int (SGPT's scheme) or one count per client (FedHPL's class_subsets)
    asked = spec.get("classes_per_client")
    most_asked = max(asked) if isinstance(asked, list) else asked
    if most_asked is not None and most_asked > facts.classes:
        return [Violation("partition.classes_per_client", asked, f"1..{facts.classes}"
                          + (" each" if isinstance(asked, list) else ""),
                          f"dataset {dataset} has {facts.classes} classes")]
    limits = scheme(spec["scheme"]).limits
    return [] if limits is None else limits(spec, facts, dataset)


def partition_id(spec: dict) -> str:
    """Short stable id for file names: '<scheme>-<8 hex of sha1(canonical json of the validated spec)>'."""
    v = validate_spec(spec)
    return f"{v['scheme']}-{hashlib.sha1(canonical_json(v).encode()).hexdigest()[:8]}"
