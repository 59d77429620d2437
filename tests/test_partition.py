"""Tests of fedcore/partition/ (schemes, validation, file, heatmaps) on small synthetic labels."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.data.facts import DatasetFacts, SplitFacts
from fedcore.partition.file import Partition
from fedcore.partition.make import class_counts, make_partition
from fedcore.partition.registry import schemes
from fedcore.partition.spec import partition_id, spec_limits, validate_spec
from fedcore.partition.plots import plot_class_heatmap

N_CLASSES, N_TRAIN_PER_CLASS, N_TEST_PER_CLASS = 10, 60, 20


def _labels(per_class: int, n_classes: int = N_CLASSES, seed: int = 0) -> np.ndarray:
    """Class-balanced labels in shuffled order (so index == position says nothing about the class)."""
    y = np.repeat(np.arange(n_classes), per_class)
    return np.random.default_rng(seed).permutation(y)


TRAIN_Y = _labels(N_TRAIN_PER_CLASS)
TEST_Y = _labels(N_TEST_PER_CLASS, seed=1)

SPECS = {
    "iid": {"scheme": "iid", "clients": 7},
    "dirichlet": {"scheme": "dirichlet", "clients": 5, "alpha": 0.5, "min_size": 5},
    "dirichlet_per_client": {
        "scheme": "dirichlet_per_client", "clients": 6, "alpha": 0.5, "train_per_client": 50, "test_per_client": 12,
    },
    "classes_per_client": {"scheme": "classes_per_client", "clients": 10, "classes_per_client": 2},
    "pathological": {
        "scheme": "pathological", "clients": 5, "classes_per_client": 2, "train_per_class": 20, "test_per_class": 5,
    },
}


def _disjoint(lists: list[np.ndarray]) -> bool:
    flat = np.concatenate(lists)
    return len(flat) == len(np.unique(flat))


def _domain_data():
    """3 domains of different sizes, 4 classes each."""
    tr_dom = np.repeat([0, 1, 2], [40, 64, 100])
    te_dom = np.repeat([0, 1, 2], [12, 20, 30])
    rng = np.random.default_rng(5)
    return rng.integers(0, 4, len(tr_dom)), rng.integers(0, 4, len(te_dom)), tr_dom, te_dom


# ---------------------------------------------------------------------------------------------
# spec validation and ids
# ---------------------------------------------------------------------------------------------


def test_validate_fills_defaults_and_is_idempotent():
    v = validate_spec({"scheme": "dirichlet", "clients": 4, "alpha": 1})
    assert v["min_size"] == 10 and v["max_tries"] == 100 and v["min_per_class_frac"] == 0.0
    assert v["balance"] is False and v["test"] == "proportional" and v["test_from"] == "test"
    assert isinstance(v["alpha"], float)
    assert validate_spec(v) == v
    assert validate_spec({"scheme": "iid", "clients": 3, "test": "split"})["test_from"] == "train"


def test_validate_unknown_scheme_names_allowed_values():
    with pytest.raises(ValueError, match="scheme") as e:
        validate_spec({"scheme": "shards", "clients": 3})
    for name in schemes():
        assert name in str(e.value)


def test_validate_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ValueError) as e:
        validate_spec({"scheme": "iid", "clients": 3, "alpah": 0.1})
    assert "'alpah'" in str(e.value) and "clients" in str(e.value) and "test_fraction" in str(e.value)


def test_validate_missing_required_and_bad_values():
    with pytest.raises(ValueError, match="'alpha'"):
        validate_spec({"scheme": "dirichlet", "clients": 3})
    with pytest.raises(ValueError, match="'clients'"):
        validate_spec({"scheme": "iid", "clients": 0})
    with pytest.raises(ValueError, match="'clients'"):
        validate_spec({"scheme": "iid", "clients": True})
    with pytest.raises(ValueError, match="'alpha'"):
        validate_spec({"scheme": "dirichlet", "clients": 3, "alpha": -1})
    with pytest.raises(ValueError, match="proportional"):
        validate_spec({"scheme": "iid", "clients": 3, "test": "local"})
    with pytest.raises(ValueError, match="'test'.*'domain'"):
        validate_spec({"scheme": "domain", "test": "split"})
    with pytest.raises(ValueError, match="test_from"):
        validate_spec({"scheme": "iid", "clients": 3, "test_from": "train"})
    assert validate_spec({"scheme": "dirichlet", "clients": 3, "alpha": "random"})["alpha"] == "random"


def test_schemes_and_test_modes_are_json_and_consistent():
    registered = schemes()
    assert set(registered) == {"iid", "dirichlet", "dirichlet_per_client", "classes_per_client", "pathological",
                               "domain", "dirichlet_overlap", "class_subsets", "fewshot_pathological", "pachinko",
                               "coarse_split"}
    for name, entry in registered.items():
        json.dumps(entry.keys)
        assert entry.keys["test"] == entry.test_modes[0]
        assert ("clients" in entry.keys) == (name != "domain")


def test_partition_id_stable_and_sensitive():
    a = partition_id({"scheme": "dirichlet", "clients": 4, "alpha": 1})
    assert a == partition_id({"alpha": 1.0, "clients": 4, "scheme": "dirichlet", "min_size": 10})
    assert a.startswith("dirichlet-") and len(a.split("-")[1]) == 8
    assert a != partition_id({"scheme": "dirichlet", "clients": 4, "alpha": 0.5})


# ---------------------------------------------------------------------------------------------
# generic properties of every label-skew scheme
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SPECS))
def test_determinism_and_seed_sensitivity(name):
    a = make_partition(SPECS[name], 3, TRAIN_Y, TEST_Y)
    b = make_partition(SPECS[name], 3, TRAIN_Y, TEST_Y)
    c = make_partition(SPECS[name], 4, TRAIN_Y, TEST_Y)
    for x, y in zip(a.train + a.test, b.train + b.test):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(a.train, c.train))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_indices_valid_and_counts_match(name):
    p = make_partition(SPECS[name], 0, TRAIN_Y, TEST_Y)
    assert p.num_clients == SPECS[name]["clients"]
    for idx, n in [(t, len(TRAIN_Y)) for t in p.train] + [(t, len(TEST_Y)) for t in p.test]:
        assert idx.dtype == np.int64 and (idx.size == 0 or (idx.min() >= 0 and idx.max() < n))
    df = class_counts(p, TRAIN_Y, TEST_Y)
    assert list(df.columns) == ["client", "split", "class", "count"] and (df["count"] > 0).all()
    tot = df.groupby(["split", "client"])["count"].sum()
    for i in range(p.num_clients):
        assert tot.get(("train", i), 0) == len(p.train[i])
        assert tot.get(("test", i), 0) == len(p.test[i])


@pytest.mark.parametrize("name", ["iid", "dirichlet", "classes_per_client", "pathological"])
def test_disjoint_train_and_test(name):
    p = make_partition(SPECS[name], 0, TRAIN_Y, TEST_Y)
    assert _disjoint(p.train) and _disjoint(p.test)


@pytest.mark.parametrize("name", ["iid", "dirichlet"])
def test_iid_and_dirichlet_cover_both_pools(name):
    p = make_partition(SPECS[name], 0, TRAIN_Y, TEST_Y)
    np.testing.assert_array_equal(np.sort(np.concatenate(p.train)), np.arange(len(TRAIN_Y)))
    # the proportional test rule hands out every test sample whose class some client trains on
    np.testing.assert_array_equal(np.sort(np.concatenate(p.test)), np.arange(len(TEST_Y)))


def test_iid_shards_near_equal():
    sizes = [len(t) for t in make_partition(SPECS["iid"], 0, TRAIN_Y, TEST_Y).train]
    assert max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------------------------------------
# dirichlet
# ---------------------------------------------------------------------------------------------


def test_dirichlet_min_size_honoured_and_error():
    spec = {"scheme": "dirichlet", "clients": 8, "alpha": 0.1, "min_size": 30}
    p = make_partition(spec, 1, TRAIN_Y, TEST_Y)
    assert min(len(t) for t in p.train) >= 30
    with pytest.raises(ValueError, match="min_size"):
        make_partition({**spec, "min_size": 200, "max_tries": 3}, 1, TRAIN_Y, TEST_Y)


def test_dirichlet_per_class_minimum():
    spec = {"scheme": "dirichlet", "clients": 5, "alpha": 0.05, "min_per_class_frac": 0.1, "min_size": 0}
    p = make_partition(spec, 2, TRAIN_Y, TEST_Y)
    m_c = int(0.1 * N_TRAIN_PER_CLASS)
    for t in p.train:
        assert np.bincount(TRAIN_Y[t], minlength=N_CLASSES).min() >= m_c
    assert _disjoint(p.train) and sum(len(t) for t in p.train) == len(TRAIN_Y)
    with pytest.raises(ValueError, match="min_per_class_frac"):
        make_partition({**spec, "min_per_class_frac": 0.3}, 2, TRAIN_Y, TEST_Y)


def test_dirichlet_balance_and_random_alpha_cover_pool():
    for extra in ({"balance": True}, {"alpha": "random"}):
        spec = {"scheme": "dirichlet", "clients": 5, "alpha": 0.3, "min_size": 1, **extra}
        p = make_partition(spec, 0, TRAIN_Y, TEST_Y)
        np.testing.assert_array_equal(np.sort(np.concatenate(p.train)), np.arange(len(TRAIN_Y)))


def test_proportional_test_follows_train_classes():
    p = make_partition({"scheme": "dirichlet", "clients": 4, "alpha": 0.1, "min_size": 1}, 0, TRAIN_Y, TEST_Y)
    for tr, te in zip(p.train, p.test):
        tr_c = np.bincount(TRAIN_Y[tr], minlength=N_CLASSES)
        te_c = np.bincount(TEST_Y[te], minlength=N_CLASSES)
        assert set(np.flatnonzero(te_c)) <= set(np.flatnonzero(tr_c))
        # per class the test share is the train share of a 3x smaller pool, up to floor rounding
        assert np.all(np.abs(te_c - tr_c * N_TEST_PER_CLASS / N_TRAIN_PER_CLASS) < 1.0 + 1e-9)


def test_test_modes_iid_full_split():
    base = {"scheme": "dirichlet", "clients": 4, "alpha": 1.0, "min_size": 1}
    iid = make_partition({**base, "test": "iid"}, 0, TRAIN_Y, TEST_Y)
    assert _disjoint(iid.test) and sum(len(t) for t in iid.test) == len(TEST_Y)
    full = make_partition({**base, "test": "full"}, 0, TRAIN_Y, TEST_Y)
    assert all(np.array_equal(t, np.arange(len(TEST_Y))) for t in full.test)
    split = make_partition({**base, "test": "split", "test_fraction": 0.25}, 0, TRAIN_Y, TEST_Y)
    assert split.spec["test_from"] == "train"
    assert _disjoint(split.train + split.test)
    np.testing.assert_array_equal(np.sort(np.concatenate(split.train + split.test)), np.arange(len(TRAIN_Y)))
    for tr, te in zip(split.train, split.test):
        assert abs(len(te) - 0.25 * (len(tr) + len(te))) <= 0.5
        # stratified: every class the client has keeps its share within one sample
        n_all = np.bincount(TRAIN_Y[np.concatenate([tr, te])], minlength=N_CLASSES)
        n_te = np.bincount(TRAIN_Y[te], minlength=N_CLASSES)
        assert np.all(np.abs(n_te - 0.25 * n_all) < 1.0)
    df = class_counts(split, TRAIN_Y, TEST_Y)  # test counts must use train labels here
    assert df[df.split == "test"]["count"].sum() == sum(len(t) for t in split.test)


# ---------------------------------------------------------------------------------------------
# classes_per_client (SGPT noniid-labeluni)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clients,s", [(10, 2), (10, 5), (20, 5)])
def test_classes_per_client_exact_classes_and_proportional_test(clients, s):
    spec = {"scheme": "classes_per_client", "clients": clients, "classes_per_client": s}
    p = make_partition(spec, 0, TRAIN_Y, TEST_Y)
    holders = np.zeros(N_CLASSES, dtype=int)
    for tr, te in zip(p.train, p.test):
        tr_c = np.bincount(TRAIN_Y[tr], minlength=N_CLASSES)
        te_c = np.bincount(TEST_Y[te], minlength=N_CLASSES)
        assert (tr_c > 0).sum() == s
        assert set(np.flatnonzero(te_c)) <= set(np.flatnonzero(tr_c))
        holders += tr_c > 0
        # both are int(pool * p) with the same share p: test ~ train * (20/60)
        held = tr_c > 0
        assert np.all(np.abs(te_c[held] - tr_c[held] * N_TEST_PER_CLASS / N_TRAIN_PER_CLASS) < 1.0)
    # balanced assignment: every class is held by exactly s*M/K clients
    assert np.all(holders == s * clients // N_CLASSES)
    # U(0.4,0.6) shares: each client's share of a class is within [0.4, 0.6]/sum of c_per_class draws
    k = s * clients // N_CLASSES
    lo, hi = int(N_TRAIN_PER_CLASS * 0.4 / (0.4 + 0.6 * (k - 1))), N_TRAIN_PER_CLASS * 0.6 / (0.6 + 0.4 * (k - 1))
    for tr in p.train:
        c = np.bincount(TRAIN_Y[tr], minlength=N_CLASSES)
        assert np.all(c[c > 0] >= lo) and np.all(c <= hi)


def test_classes_per_client_follows_reference_when_s_does_not_divide_k():
    # the reference draw may hand one client two shares of a class when s does not divide K;
    # it is reproduced as is, so the client then holds fewer than s distinct classes
    spec = {"scheme": "classes_per_client", "clients": 5, "classes_per_client": 4}
    distinct = [len(np.unique(TRAIN_Y[t])) for t in make_partition(spec, 3, TRAIN_Y, TEST_Y).train]
    assert min(distinct) == 3 and max(distinct) == 4


def test_classes_per_client_indivisible_error():
    with pytest.raises(ValueError, match="count_per_class"):
        make_partition({"scheme": "classes_per_client", "clients": 7, "classes_per_client": 3}, 0, TRAIN_Y, TEST_Y)


# ---------------------------------------------------------------------------------------------
# pathological and dirichlet_per_client (FedPFT)
# ---------------------------------------------------------------------------------------------


def test_pathological_exact_counts_and_pool_error():
    p = make_partition(SPECS["pathological"], 0, TRAIN_Y, TEST_Y)
    for tr, te in zip(p.train, p.test):
        tr_c = np.bincount(TRAIN_Y[tr], minlength=N_CLASSES)
        te_c = np.bincount(TEST_Y[te], minlength=N_CLASSES)
        assert sorted(tr_c[tr_c > 0]) == [20, 20] and sorted(te_c[te_c > 0]) == [5, 5]
        assert set(np.flatnonzero(te_c)) == set(np.flatnonzero(tr_c))
    with pytest.raises(ValueError, match="train_per_class"):
        make_partition({**SPECS["pathological"], "train_per_class": 61}, 0, TRAIN_Y, TEST_Y)


def test_pathological_never_repeats_within_client_when_pools_run_dry():
    spec = {**SPECS["pathological"], "clients": 30, "train_per_class": 25}  # ~6 holders x 25 > 60 per class
    p = make_partition(spec, 0, TRAIN_Y, TEST_Y)
    assert all(len(np.unique(t)) == len(t) == 50 for t in p.train)


def test_dirichlet_per_client_exact_totals():
    p = make_partition(SPECS["dirichlet_per_client"], 0, TRAIN_Y, TEST_Y)
    assert all(len(t) == 50 for t in p.train) and all(len(t) == 12 for t in p.test)
    for t in p.train:
        assert len(np.unique(t)) == len(t)  # without replacement within a client (pools are large enough)
    # test sizes are largest-remainder shares of the same q, so they sit close to the train mix
    for tr, te in zip(p.train, p.test):
        assert np.all(np.abs(np.bincount(TEST_Y[te], minlength=N_CLASSES) / 12
                             - np.bincount(TRAIN_Y[tr], minlength=N_CLASSES) / 50) < 1 / 12 + 1 / 50 + 1e-9)


def test_dirichlet_per_client_replacement_only_when_needed():
    spec = {**SPECS["dirichlet_per_client"], "alpha": 0.01, "test_per_client": 40}  # > 20 per class pool
    p = make_partition(spec, 0, TRAIN_Y, TEST_Y)
    assert all(len(t) == 40 for t in p.test)
    assert any(len(np.unique(t)) < len(t) for t in p.test)


# ---------------------------------------------------------------------------------------------
# domain
# ---------------------------------------------------------------------------------------------


def test_domain_clients_hold_only_their_domain():
    tr_y, te_y, tr_d, te_d = _domain_data()
    p = make_partition({"scheme": "domain", "clients_per_domain": 2}, 0, tr_y, te_y, tr_d, te_d)
    assert p.num_clients == 6
    for i, (tr, te) in enumerate(zip(p.train, p.test)):
        assert set(tr_d[tr]) == {i // 2} and set(te_d[te]) == {i // 2}
    np.testing.assert_array_equal(np.sort(np.concatenate(p.train)), np.arange(len(tr_y)))
    np.testing.assert_array_equal(np.sort(np.concatenate(p.test)), np.arange(len(te_y)))


def test_domain_equal_test_size_and_fraction_of_min():
    tr_y, te_y, tr_d, te_d = _domain_data()
    spec = {"scheme": "domain", "train_fraction_of_min": 0.5, "equal_test_size": True}
    p = make_partition(spec, 0, tr_y, te_y, tr_d, te_d)
    assert [len(t) for t in p.train] == [20, 20, 20]  # int(0.5 * min(40, 64, 100))
    assert [len(t) for t in p.test] == [12, 12, 12]
    assert _disjoint(p.train) and _disjoint(p.test)
    for i, (tr, te) in enumerate(zip(p.train, p.test)):
        assert set(tr_d[tr]) == {i} and set(te_d[te]) == {i}
        # the SGPT code keeps the first samples of the domain's file, not a random subset
        np.testing.assert_array_equal(tr, np.flatnonzero(tr_d == i)[:20])
    # the fraction leaves the test shards as they were without it
    whole = make_partition({"scheme": "domain", "equal_test_size": True}, 0, tr_y, te_y, tr_d, te_d)
    assert all(np.array_equal(a, b) for a, b in zip(p.test, whole.test))


def test_domain_needs_domain_arrays_and_nonempty_clients():
    with pytest.raises(ValueError, match="train_domain"):
        make_partition({"scheme": "domain"}, 0, TRAIN_Y, TEST_Y)
    tr_y, te_y, tr_d, te_d = _domain_data()
    with pytest.raises(ValueError, match="without train samples"):
        make_partition({"scheme": "domain", "train_fraction_of_min": 0.01}, 0, tr_y, te_y, tr_d, te_d)


# ---------------------------------------------------------------------------------------------
# persistence and plots
# ---------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    p = make_partition({**SPECS["dirichlet"], "test": "split"}, 9, TRAIN_Y, TEST_Y)
    path = tmp_path / "sub" / "part.npz"
    p.save(path)
    assert path.exists() and not [f for f in path.parent.iterdir() if f.name.startswith(".")]
    q = Partition.load(path)
    assert q.spec == p.spec and q.seed == 9 and q.num_clients == p.num_clients and q.test_from == "train"
    for x, y in zip(p.train + p.test, q.train + q.test):
        np.testing.assert_array_equal(x, y)
        assert y.dtype == np.int64


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Partition.load(tmp_path / "nope.npz")
    other = tmp_path / "other.npz"
    np.savez(other, x=np.arange(3))
    with pytest.raises(ValueError, match="not a fedcore partition"):
        Partition.load(other)
    junk = tmp_path / "junk.npz"
    junk.write_text("hello")
    with pytest.raises(ValueError, match=r"junk\.npz is unreadable or incomplete .*rule partition"):
        Partition.load(junk)


def test_heatmap_writes_png_and_pdf(tmp_path):
    p = make_partition(SPECS["classes_per_client"], 0, TRAIN_Y, TEST_Y)
    df = class_counts(p, TRAIN_Y, TEST_Y)
    png, pdf = tmp_path / "h.png", tmp_path / "h.pdf"
    plot_class_heatmap(df, png, pdf, "classes_per_client s=2")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert pdf.read_bytes()[:4] == b"%PDF" and pdf.stat().st_size > 1000


# ---------------------------------------------------------------------------------------------
# property test: dirichlet is always a disjoint cover honouring its minima
# ---------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    clients=st.integers(2, 8),
    alpha=st.sampled_from([0.05, 0.3, 1.0, 10.0]),
    frac=st.sampled_from([0.0, 0.05, 0.1]),
    balance=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_dirichlet_property(clients, alpha, frac, balance, seed):
    spec = {"scheme": "dirichlet", "clients": clients, "alpha": alpha, "min_size": 1,
            "min_per_class_frac": frac, "balance": balance}
    p = make_partition(spec, seed, TRAIN_Y, TEST_Y)
    np.testing.assert_array_equal(np.sort(np.concatenate(p.train)), np.arange(len(TRAIN_Y)))
    m_c = int(frac * N_TRAIN_PER_CLASS)
    assert all(np.bincount(TRAIN_Y[t], minlength=N_CLASSES).min() >= m_c for t in p.train)
    assert min(len(t) for t in p.train) >= 1


def test_classes_per_client_limit_is_the_largest_count_that_never_empties_a_share():
    """spec_limits' bound on clients (config time, from class sizes only) holds for every draw; one step more is
    refused."""
    facts = DatasetFacts(N_CLASSES, 0, SplitFacts(N_CLASSES * N_TRAIN_PER_CLASS, N_TRAIN_PER_CLASS),
                         SplitFacts(N_CLASSES * N_TEST_PER_CLASS, N_TEST_PER_CLASS))
    spec = validate_spec({"scheme": "classes_per_client", "clients": 70, "classes_per_client": 2})
    [v] = spec_limits(spec, facts, "toy")  # 20 test images a class: at most 1 + 2 * 19 // 3 = 13 sharers
    assert v.key == "partition.clients" and v.allowed == "5..65 in steps of 5"
    spec = validate_spec({**spec, "clients": 65})  # 13 sharers: each class's smallest share is 20 * 0.4 / 7.6 > 1
    assert spec_limits(spec, facts, "toy") == []
    train_y, test_y = _labels(N_TRAIN_PER_CLASS), _labels(N_TEST_PER_CLASS, seed=1)
    for seed in range(5):
        p = make_partition(spec, seed, train_y, test_y)
        for tr, te in zip(p.train, p.test):
            assert len(np.unique(train_y[tr])) == len(np.unique(test_y[te])) == 2
