"""`keep_fraction`: each client trains on a seeded, class-stratified share of its partition (FedHPL Fig. 3(b)).

The share must be a subset of the full partition's client data, hold round(f * n_c) of every class, grow by
supersets as f grows, leave the test sets alone, and at f = 1 be the full partition itself (same id, same bytes).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.partition.make import make_partition
from fedcore.partition.spec import partition_id, validate_spec


def _labels(per_class: list[int], seed: int) -> np.ndarray:
    """Shuffled labels with the given per-class counts."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(len(per_class)), per_class))


TRAIN_Y, TEST_Y = _labels([50, 70, 40, 60, 55, 45, 65, 50, 30, 80], 0), _labels([20] * 10, 1)
DOMAINS = (np.arange(len(TRAIN_Y)) % 3, np.arange(len(TEST_Y)) % 3)
FEDHPL_IID = {"scheme": "iid", "clients": 5, "min_per_class_frac": 0.01, "test": "full"}  # Fig. 3(b)'s base
BASES = {
    "fedhpl_iid": FEDHPL_IID,
    "iid_proportional": {"scheme": "iid", "clients": 4},
    "iid_split": {"scheme": "iid", "clients": 4, "test": "split"},
    "noniid": {"scheme": "dirichlet", "clients": 5, "alpha": "random", "min_size": 0, "min_per_class_frac": 0.01,
               "test": "full"},
    "dir_overlap": {"scheme": "dirichlet_overlap", "clients": 5, "alpha": "random", "alpha_sum": "classes",
                    "min_per_class_frac": 0.01},
    "classes_per_client": {"scheme": "classes_per_client", "clients": 10, "classes_per_client": 5},
    "domain": {"scheme": "domain", "clients_per_domain": 2},
}


def _make(spec: dict, seed: int = 0):
    domains = DOMAINS if spec["scheme"] == "domain" else (None, None)
    return make_partition(spec, seed, TRAIN_Y, TEST_Y, *domains)


@pytest.mark.parametrize("name", sorted(BASES))
def test_full_share_is_the_partition_itself(name):
    base = BASES[name]
    assert validate_spec({**base, "keep_fraction": 1}) == validate_spec(base)  # the key is left out at 1
    assert partition_id({**base, "keep_fraction": 1.0}) == partition_id(base)
    a, b = _make(base), _make({**base, "keep_fraction": 1.0})
    for x, y in zip(a.train + a.test, b.train + b.test, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", sorted(BASES))
@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8])
def test_share_is_a_stratified_subset_with_the_same_test_sets(name, fraction):
    base = _make(BASES[name])
    part = _make({**BASES[name], "keep_fraction": fraction})
    assert part.spec["keep_fraction"] == fraction
    assert partition_id({**BASES[name], "keep_fraction": fraction}) != partition_id(BASES[name])
    for full, kept, t_full, t_kept in zip(base.train, part.train, base.test, part.test, strict=True):
        np.testing.assert_array_equal(t_full, t_kept)                 # tests are the full partition's
        assert len(np.unique(kept)) == len(kept)
        np.testing.assert_array_equal(kept, full[np.isin(full, kept)])  # a subset, in the client's order
        classes, n_c = np.unique(TRAIN_Y[full], return_counts=True)
        got = dict(zip(*np.unique(TRAIN_Y[kept], return_counts=True)))
        for c, n in zip(classes, n_c):  # round half up of f * n_c, per class
            assert got.get(c, 0) == math.floor(fraction * n + 0.5)


def test_larger_share_keeps_a_superset_and_seeds_matter():
    shares = [_make({**FEDHPL_IID, "keep_fraction": f}) for f in (0.2, 0.4, 0.6, 0.8)]
    full = _make(FEDHPL_IID)
    for small, large in zip(shares, shares[1:] + [full]):
        for s, g in zip(small.train, large.train, strict=True):
            assert np.isin(s, g).all() and len(s) < len(g)
    again = _make({**FEDHPL_IID, "keep_fraction": 0.4})
    other = _make({**FEDHPL_IID, "keep_fraction": 0.4}, seed=1)
    for x, y in zip(shares[1].train, again.train, strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(shares[1].train, other.train))


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, "half", True, None, float("nan")])
def test_bad_fraction_is_named(bad):
    with pytest.raises(ValueError, match=r"'keep_fraction' must be a number in \(0.0, 1.0\]"):
        validate_spec({**FEDHPL_IID, "keep_fraction": bad})


def test_share_that_empties_a_client_is_an_error():
    y = np.repeat(np.arange(10), 2)  # 2 clients x 10 samples, one per class: 0.04 rounds every class to 0
    with pytest.raises(ValueError, match="keep_fraction=0.04 leaves client 0 without train samples"):
        make_partition({"scheme": "iid", "clients": 2, "keep_fraction": 0.04}, 0, y, y)


@settings(max_examples=25, deadline=None)
@given(fraction=st.floats(0.1, 1.0), seed=st.integers(0, 2**16), name=st.sampled_from(sorted(BASES)))
def test_share_properties_for_random_fractions(fraction, seed, name):
    base = _make(BASES[name], seed)
    kept_counts = [np.floor(fraction * np.bincount(TRAIN_Y[full], minlength=10) + 0.5).sum() for full in base.train]
    if min(kept_counts) == 0:  # a share that empties a client is refused (fraction 0.125 of a 5-sample client)
        with pytest.raises(ValueError, match=f"keep_fraction={fraction} leaves client"):
            _make({**BASES[name], "keep_fraction": fraction}, seed)
        return
    part = _make({**BASES[name], "keep_fraction": fraction}, seed)
    for full, kept in zip(base.train, part.train, strict=True):
        assert np.isin(kept, full).all()
        n_c = np.bincount(TRAIN_Y[full], minlength=10)
        want = np.floor(fraction * n_c + 0.5).astype(int)
        np.testing.assert_array_equal(np.bincount(TRAIN_Y[kept], minlength=10), want)
