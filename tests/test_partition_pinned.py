"""The existing partition schemes must keep giving byte-identical partitions (SGPT's runs depend on them).

Each digest covers the validated spec, the partition id and every client's train and test index array.
The digests were recorded from the code before the FedHPL schemes were added (commit 11f8d27); a change
to any helper these schemes share with newer ones shows up here as a mismatch.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from fedcore.partition.file import Partition
from fedcore.partition.make import make_partition
from fedcore.partition.spec import partition_id


def _labels(per_class: list[int], seed: int) -> np.ndarray:
    """Shuffled labels with the given per-class counts."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(len(per_class)), per_class))


SMALL = (_labels([60] * 10, 0), _labels([20] * 10, 1))
C100 = (_labels([500] * 100, 2), _labels([100] * 100, 3))
DOMAINS = (np.repeat([0, 1, 2], [40, 64, 100]), np.repeat([0, 1, 2], [12, 20, 30]))

# (labels, spec) pairs: the unit tests' specs, SGPT's paper and mini specs, and every test rule
CASES = {
    "iid": (SMALL, {"scheme": "iid", "clients": 7}),
    "iid_split": (SMALL, {"scheme": "iid", "clients": 4, "test": "split"}),
    "iid_iid": (SMALL, {"scheme": "iid", "clients": 4, "test": "iid"}),
    "iid_full": (SMALL, {"scheme": "iid", "clients": 4, "test": "full"}),
    "dirichlet": (SMALL, {"scheme": "dirichlet", "clients": 5, "alpha": 0.5, "min_size": 5}),
    "dirichlet_random_min": (SMALL, {"scheme": "dirichlet", "clients": 5, "alpha": "random", "min_size": 0,
                                     "min_per_class_frac": 0.1, "test": "full"}),
    "dirichlet_balance_split": (SMALL, {"scheme": "dirichlet", "clients": 4, "alpha": 0.3, "min_size": 1,
                                        "balance": True, "test": "split"}),
    "dirichlet_per_client": (SMALL, {"scheme": "dirichlet_per_client", "clients": 6, "alpha": 0.5,
                                     "train_per_client": 50, "test_per_client": 12}),
    "classes_per_client_mini": (SMALL, {"scheme": "classes_per_client", "clients": 10, "classes_per_client": 5}),
    "classes_per_client_s50": (C100, {"scheme": "classes_per_client", "clients": 100, "classes_per_client": 50}),
    "classes_per_client_s10": (C100, {"scheme": "classes_per_client", "clients": 100, "classes_per_client": 10}),
    "pathological": (SMALL, {"scheme": "pathological", "clients": 5, "classes_per_client": 2,
                             "train_per_class": 20, "test_per_class": 5}),
    "domain_five": (DOMAINS, {"scheme": "domain", "clients_per_domain": 2, "equal_test_size": True}),
    "domain_office": (DOMAINS, {"scheme": "domain", "train_fraction_of_min": 0.5}),
}

DIGESTS = {
    "iid": "25269bafbc4780b6209464a90cb693270c8680c16834ea9fb5c790d3cd93750f",
    "iid_split": "96c2b927af1543c9725e318964939ac86dc68fa29037163a78b61a4f4aa4d2ab",
    "iid_iid": "c9213b0670812a22fc91dfc9f47774ee9c4c856c570f4bddc2b09c6382627e76",
    "iid_full": "f4b9dc52fa623323485a6e7befbf6b24db784688f362a1714b30a04ecd1c3d3f",
    "dirichlet": "1bac6ea15ce2338c3b48c1c3d69a807bbf3a24089341a83da6e4a74469501d06",
    "dirichlet_random_min": "5eb3373e2ad3e73cc2bf9688e2288ca2db95472ceca3780b171b9b8614fb20c9",
    "dirichlet_balance_split": "ccc424c890664d903ec084ecb5f6eb06638d1687877026c58421a5988f02fe5d",
    "dirichlet_per_client": "c7d2a2817268b4eb69802a132457aa974394c177f1c14763e90c9f0467da8395",
    "classes_per_client_mini": "27be61f9c661a0f00c99252836ee702728a0935e2b2a5ea6bc6c772731059449",
    "classes_per_client_s50": "1a452ff4937806188fd7044f723fd51e4e1e4658fb088032009661bbc71f4f5e",
    "classes_per_client_s10": "891e66988865d587a0ce1803ebe7e9d38e6c860c366ade5de0fea0255567635f",
    "pathological": "2911215fb38c5a4b3c3714760a9ea550ae49ca26b1f5bf33c4ccb8001cd70f76",
    "domain_five": "97b4009a40b43c7f9cbfc908544b6c2aeac42ef23c6b3ca8cc441fd3dc06c9e5",
    # changed on purpose (SGPT audit, issue 12 item 2): the train subset is now the file-order prefix the code keeps
    "domain_office": "f1a2ea271ef5e693e5b7c462a809e90871d7d60f35c0ec13627fafebc26581bd",
}


def digest(p: Partition) -> str:
    """sha256 of the validated spec, the partition id and all index arrays with their client boundaries."""
    h = hashlib.sha256()
    h.update(json.dumps(p.spec, sort_keys=True).encode())
    h.update(partition_id(p.spec).encode())
    for lists in (p.train, p.test):
        h.update(np.array([len(a) for a in lists], dtype=np.int64).tobytes())
        for a in lists:
            h.update(a.astype(np.int64).tobytes())
    return h.hexdigest()


def _make(name: str, seed: int = 0) -> Partition:
    (y_train, y_test), spec = CASES[name]
    if spec["scheme"] == "domain":
        rng = np.random.default_rng(5)  # class labels inside the domains
        return make_partition(spec, seed, rng.integers(0, 4, len(y_train)), rng.integers(0, 4, len(y_test)),
                              y_train, y_test)
    return make_partition(spec, seed, y_train, y_test)


@pytest.mark.parametrize("name", sorted(CASES))
def test_existing_schemes_unchanged(name):
    assert digest(_make(name)) == DIGESTS[name]
