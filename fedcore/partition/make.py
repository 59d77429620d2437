"""Making a partition: the spec's scheme draws it from the dataset's labels (fedcore/partition/schemes/), then the
keys every scheme takes apply (``test: full``, ``keep_fraction``, FedOTP's ``bug_compat_*``); and its per-client class
counts (the partition rule's summary and heatmaps).

A partition is a pure function of (validated spec, seed, labels[, domains or coarse classes]). All randomness comes
from one ``np.random.default_rng(seed)`` threaded through the scheme's draw, so the same inputs always give identical
index arrays, and every method of an experiment trains on the same client data.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from fedcore.partition.class_order import classname_order
from fedcore.partition.draw import check_labels, keep_share
from fedcore.partition.file import Partition
from fedcore.partition.registry import Labels, scheme
from fedcore.partition.schemes.fedotp import office_label_images
from fedcore.partition.spec import validate_spec

# what a scheme that needs domains or coarse classes says when they are missing
_MISSING = {"domain": "needs train_domain and test_domain arrays",
            "coarse": "needs coarse labels for both splits (the dataset bundle's 'coarse' arrays, e.g. CIFAR-100's 20 "
                      "superclasses)"}


def _labels(name: str, needs: tuple[str, ...], train_y: np.ndarray, test_y: np.ndarray,
            extra: dict[str, tuple[np.ndarray | None, np.ndarray | None]]) -> Labels:
    """The checked label arrays a scheme draws from: the classes, and the domains or coarse classes it needs."""
    given: dict[str, np.ndarray] = {}
    for kind in needs:
        train, test = extra[kind]
        if train is None or test is None:
            raise ValueError(f"partition scheme {name!r} {_MISSING[kind]}")
        given[f"train_{kind}"] = check_labels(f"train_{kind}", train)
        given[f"test_{kind}"] = check_labels(f"test_{kind}", test)
        if len(given[f"train_{kind}"]) != len(train_y) or len(given[f"test_{kind}"]) != len(test_y):
            raise ValueError(f"{kind} arrays must have one entry per sample of their split")
    return Labels(train_y, test_y, **given)


def make_partition(
    spec: dict,
    seed: int,
    train_y: np.ndarray,
    test_y: np.ndarray,
    train_domain: np.ndarray | None = None,
    test_domain: np.ndarray | None = None,
    train_coarse: np.ndarray | None = None,
    test_coarse: np.ndarray | None = None,
) -> Partition:
    """Build the partition a spec describes, deterministically from `seed` (or the spec's `fixed_seed`)."""
    spec = validate_spec(spec)
    train_y, test_y = check_labels("train_y", train_y), check_labels("test_y", test_y)
    if spec.get("fixed_seed") is not None:
        seed = spec["fixed_seed"]
    rng = np.random.default_rng(seed)
    entry = scheme(spec["scheme"])
    labels = _labels(entry.name, entry.needs, train_y, test_y,
                     {"domain": (train_domain, test_domain), "coarse": (train_coarse, test_coarse)})
    train, test = entry.draw(spec, labels, rng)
    if spec["test"] == "full":
        test = [np.arange(len(test_y), dtype=np.int64) for _ in train]
    if spec.get("keep_fraction", 1.0) < 1.0:  # after every other draw: the full partition is unchanged
        train = keep_share(train, train_y, spec["keep_fraction"], rng)
    extra: dict[str, Any] = {}
    if spec.get("bug_compat_office_labels"):  # the indices above stay the correct partition; only images move
        extra["train_images"] = office_label_images(train, labels.train_domain, rng)
        extra["test_images"] = office_label_images(test, labels.test_domain, rng)
    if spec.get("bug_compat_classname_order"):
        n = int(max(train_y.max(initial=-1), test_y.max(initial=-1))) + 1
        extra["class_order"] = classname_order(n, seed)
    return Partition(train=train, test=test, spec=spec, seed=seed, **extra)


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
