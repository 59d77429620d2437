"""Scheme ``domain``: one or more clients per domain (Office, DomainNet, Five-dataset): IID shards of every domain,
or with ``alpha`` a per-class Dirichlet split inside every domain (FedOTP's feature & label shift, fedotp.py)."""
from __future__ import annotations

import numpy as np

from fedcore.constraints import Violation
from fedcore.data.facts import DatasetFacts
from fedcore.partition.registry import Labels, register_scheme
from fedcore.partition.schemes.fedotp import domain_dirichlet

# with alpha only: the train samples every client needs (redrawn until it has them), and the code's image/label
# misalignment (fedotp.office_label_images)
ALPHA_ONLY = {"min_size": 2, "bug_compat_office_labels": False}


def _check_alpha_only(out: dict) -> None:
    """min_size and bug_compat_office_labels apply only with alpha."""
    if out["alpha"] is None:
        for key, default in ALPHA_ONLY.items():
            if out[key] != default:
                raise ValueError(f"partition key {key!r} of scheme 'domain' applies only with 'alpha' (the per-class "
                                 f"Dirichlet split inside each domain)")


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


@register_scheme("domain", keys={"clients_per_domain": 1, "train_fraction_of_min": None, "equal_test_size": False,
                                 # FedOTP feature & label shift: per-class Dir(alpha) over a domain's clients
                                 "alpha": None, **ALPHA_ONLY, "test": "domain"},
                 test_modes=("domain", "full"), needs=("domain",), check=_check_alpha_only, limits=_domain_limits,
                 omitted_at_default=("alpha", *ALPHA_ONLY))
def domain(spec: dict, labels: Labels, rng: np.random.Generator):
    """IID shards (or, with alpha, per-class Dirichlet shares) of every domain's train and test sets; client
    order = domain order, then shard."""
    train_y, test_y, train_domain, test_domain = labels.train_y, labels.test_y, labels.train_domain, labels.test_domain
    k = spec["clients_per_domain"]
    domains = np.unique(train_domain)
    missing = sorted(set(np.unique(test_domain).tolist()) - set(domains.tolist()))
    if missing:
        raise ValueError(f"domain partition: test domains {missing} have no train samples")
    in_file_order = spec["train_fraction_of_min"] is not None
    if spec.get("alpha") is not None:
        min_size = spec.get("min_size", ALPHA_ONLY["min_size"])  # left out of the spec at its default
        train, test = domain_dirichlet(spec["alpha"], min_size, k, train_y, test_y, train_domain, test_domain, rng)
    else:
        train, test = [], []
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
