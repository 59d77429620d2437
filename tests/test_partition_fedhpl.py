"""Property tests of FedHPL's partitions (spec fedhpl §3.2, paper B.2, C.3, C.5.4).

On synthetic labels with the sizes of CIFAR-10, CIFAR-100 and SVHN (SVHN's real per-class counts) and on the
embedded digits of the mini scale: IID, overlapping "Dir", disjoint "Non-IID" (random alpha and the alpha
sweep), and the baselines' original 80/20 protocol with class subsets, each with the paper's per-class minimum.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.partition.file import Partition
from fedcore.partition.make import class_counts, make_partition
from fedcore.partition.spec import partition_id, validate_spec
from fedcore.partition.schemes.fedhpl import random_alpha
from fedcore.partition.plots import plot_class_heatmap

K = 5


def _labels(per_class: list[int], seed: int) -> np.ndarray:
    """Shuffled labels with the given per-class counts."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(len(per_class)), per_class))


SVHN_TRAIN = [4948, 13861, 10585, 8497, 7458, 6882, 5727, 5595, 5045, 4659]  # spec fedhpl §3.1
SVHN_TEST = [1744, 5099, 4149, 2882, 2523, 2384, 1977, 2019, 1660, 1595]
# dataset -> (train labels, test labels, per-class minimum (C.5.4), Dir normalisation (B.2), class subsets (C.3))
DATASETS = {
    "cifar10": (_labels([5000] * 10, 0), _labels([1000] * 10, 1), 0.01, "classes", [2, 4, 6, 8, 10]),
    "cifar100": (_labels([500] * 100, 2), _labels([100] * 100, 3), 0.10, "clients", [10, 30, 50, 70, 100]),
    "svhn": (_labels(SVHN_TRAIN, 4), _labels(SVHN_TEST, 5), 0.005, "clients", [2, 4, 6, 8, 10]),
}


def fedhpl_specs(pct: float, alpha_sum: str, subsets: list[int]) -> dict[str, dict]:
    """Every FedHPL data setting of one dataset as partition specs (names as spec fedhpl §7.1)."""
    base = {"clients": K, "min_per_class_frac": pct}
    noniid = {"scheme": "dirichlet", **base, "min_size": 0, "test": "full"}
    orig = {"scheme": "class_subsets", **base, "classes_per_client": subsets}
    return {
        "iid": {"scheme": "iid", **base, "test": "full"},
        "dir": {"scheme": "dirichlet_overlap", **base, "alpha": "random", "alpha_sum": alpha_sum},
        "noniid": {**noniid, "alpha": "random"},
        "noniid_a0.1": {**noniid, "alpha": 0.1},
        "noniid_a0.5": {**noniid, "alpha": 0.5},
        "noniid_a1.0": {**noniid, "alpha": 1.0},
        "orig_iid": {**orig, "setting": "iid"},
        "orig_dir": {**orig, "setting": "dirichlet_overlap", "alpha": "random", "alpha_sum": alpha_sum},
        "orig_noniid": {**orig, "setting": "dirichlet", "alpha": "random"},
    }


SETTINGS = sorted(fedhpl_specs(0.01, "classes", [1]))
DISJOINT = {"iid", "noniid", "noniid_a0.1", "noniid_a0.5", "noniid_a1.0", "orig_iid", "orig_noniid"}


def _spec(dataset: str, setting: str) -> dict:
    _, _, pct, alpha_sum, subsets = DATASETS[dataset]
    return fedhpl_specs(pct, alpha_sum, subsets)[setting]


def _make(dataset: str, setting: str, seed: int = 0) -> Partition:
    train_y, test_y = DATASETS[dataset][:2]
    return make_partition(_spec(dataset, setting), seed, train_y, test_y)


def _digest(p: Partition) -> str:
    h = hashlib.sha256()
    for lists in (p.train, p.test):
        h.update(np.array([len(a) for a in lists], dtype=np.int64).tobytes())
        for a in lists:
            h.update(a.tobytes())
    return h.hexdigest()


def _disjoint(lists: list[np.ndarray]) -> bool:
    flat = np.concatenate(lists)
    return len(flat) == len(np.unique(flat))


def _counts(lists: list[np.ndarray], y: np.ndarray, n_classes: int) -> np.ndarray:
    return np.stack([np.bincount(y[t], minlength=n_classes) for t in lists])


def check_invariants(p: Partition, train_y: np.ndarray, test_y: np.ndarray) -> None:
    """Everything the paper and DEVIATIONS.md promise of a FedHPL partition, for any labels."""
    spec, k = p.spec, p.spec["clients"]
    n_c = np.bincount(train_y)
    n = len(train_y)
    assert p.num_clients == k
    for t in p.train + p.test:
        assert t.dtype == np.int64 and len(np.unique(t)) == len(t)  # no sample twice within a client
    tr_counts = _counts(p.train, train_y, len(n_c))
    if spec["scheme"] != "class_subsets":
        assert p.test_from == "test"
        for t in p.test:
            assert t.size == 0 or (t.min() >= 0 and t.max() < len(test_y))
        # the per-class minimum floor(pct * N_c), for every client and every class
        assert (tr_counts >= np.floor(spec.get("min_per_class_frac", 0.0) * n_c)).all()  # iid omits it at 0
        sizes = np.array([len(t) for t in p.train])
        assert sizes.sum() == n
        if spec["scheme"] == "dirichlet_overlap":
            assert sizes.max() - sizes.min() <= 1  # |D_k| = N/K
            assert (tr_counts <= n_c).all()
        else:  # IID and Non-IID: disjoint, and together the whole train split
            np.testing.assert_array_equal(np.sort(np.concatenate(p.train)), np.arange(n))
        if spec["scheme"] == "iid":
            assert sizes.max() - sizes.min() <= 1
        return
    # class_subsets: the 80/20 split of every class, done before partitioning; both sides index the train split
    assert p.test_from == "train"
    n_test_c = np.array([int(round(spec["test_fraction"] * x)) for x in n_c])
    pool_c = n_c - n_test_c
    assert not set(np.concatenate(p.train).tolist()) & set(np.concatenate(p.test).tolist())
    te_counts = _counts(p.test, train_y, len(n_c))
    minimum = np.floor(spec["min_per_class_frac"] * pool_c).astype(int)
    for i, s in enumerate(spec["classes_per_client"]):
        held = tr_counts[i] > 0
        assert held.sum() == s if minimum.min() >= 1 else held.sum() <= s  # client i holds s of the classes
        assert (tr_counts[i][held] >= minimum[held]).all()
        assert set(np.flatnonzero(te_counts[i])) <= set(np.flatnonzero(held))  # tested on its own classes only
    if spec["setting"] == "dirichlet_overlap":
        assert (tr_counts <= pool_c).all() and (te_counts <= n_test_c).all()
        # each client mirrors its train counts in the 20 % pool, rounded
        assert (np.abs(te_counts - tr_counts * n_test_c / pool_c) <= 0.5 + 1e-9).all()
        budget = n - n_test_c.sum()
        for i in range(k):
            available = pool_c[tr_counts[i] > 0].sum()
            assert abs(len(p.train[i]) - min(budget / k, available)) <= 1  # |D_k| = N/K, or all it can hold
    else:
        assert _disjoint(p.train) and _disjoint(p.test)
        held_by_some = tr_counts.sum(axis=0) > 0
        # the whole 80 % pool of every held class is handed out, and its 20 % pool cut in the same shares
        np.testing.assert_array_equal(tr_counts.sum(axis=0)[held_by_some], pool_c[held_by_some])
        np.testing.assert_array_equal(te_counts.sum(axis=0)[held_by_some], n_test_c[held_by_some])
        assert (np.abs(te_counts - tr_counts * n_test_c / pool_c) < 1.0).all()


# ---------------------------------------------------------------------------------------------
# the paper's settings on CIFAR-10/100 and SVHN sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_paper_settings_hold_their_invariants(dataset, setting):
    train_y, test_y = DATASETS[dataset][:2]
    p = _make(dataset, setting)
    check_invariants(p, train_y, test_y)
    if setting in DISJOINT:
        assert _disjoint(p.train)
    if not setting.startswith("orig"):
        # FedHPL tests every client model on the entire test split
        assert all(np.array_equal(t, np.arange(len(test_y))) for t in p.test)


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_dir_shares_samples_between_clients(dataset):
    train_y = DATASETS[dataset][0]
    for setting in ("dir", "orig_dir"):
        flat = np.concatenate(_make(dataset, setting).train)
        assert len(np.unique(flat)) < len(flat), f"{setting}: no sample is shared; the paper's Dir overlaps"
    # the paper's Dir total is N, so overlap leaves some samples unused
    assert len(np.unique(np.concatenate(_make(dataset, "dir").train))) < len(train_y)


def test_per_class_minimum_is_the_papers():
    # C.5.4: 1 % / 10 % / 0.5 %; "only 27 samples in label 7" on SVHN = floor(0.005 * 5595)
    train_y = DATASETS["svhn"][0]
    counts = _counts(_make("svhn", "noniid_a0.1").train, train_y, 10)
    assert counts[:, 7].min() == math.floor(0.005 * 5595) == 27  # at alpha 0.1 the minimum binds
    for dataset, floor in (("cifar10", 50), ("cifar100", 50)):
        counts = _counts(_make(dataset, "noniid_a0.1").train, DATASETS[dataset][0], 100)
        assert counts[:, : len(np.unique(DATASETS[dataset][0]))].min() == floor


def test_iid_minimum_binds_where_plain_shards_miss_it():
    # a rare class of 10 samples over 5 clients at 20 %: every client must hold exactly 2 of it
    train_y = _labels([10, 990], 8)
    test_y = _labels([5, 95], 9)
    plain = make_partition({"scheme": "iid", "clients": 5}, 0, train_y, test_y)
    fixed = make_partition({"scheme": "iid", "clients": 5, "min_per_class_frac": 0.2}, 0, train_y, test_y)
    assert _counts(plain.train, train_y, 2)[:, 0].tolist() != [2] * 5  # the seed-0 shards miss it ...
    assert _counts(fixed.train, train_y, 2)[:, 0].tolist() == [2] * 5  # ... the minimum fixes it
    check_invariants(fixed, train_y, test_y)


def test_random_alpha_normalisation():
    rng = np.random.default_rng(0)
    held = rng.random((5, 12)) < 0.7
    held[:, 0] = held[0, :] = True
    for axis, alpha_sum in ((1, "classes"), (0, "clients")):
        a = random_alpha(np.random.default_rng(1), held, alpha_sum)
        np.testing.assert_allclose(a.sum(axis=axis), 1.0)
        assert (a[held] > 0).all() and (a[~held] == 0).all()


def test_dir_normalisation_changes_the_partition():
    # the same draw normalised per client (CIFAR-10) or per class (CIFAR-100, SVHN) is a different partition
    spec = _spec("cifar10", "dir")
    train_y, test_y = DATASETS["cifar10"][:2]
    a = make_partition(spec, 0, train_y, test_y)
    b = make_partition({**spec, "alpha_sum": "clients"}, 0, train_y, test_y)
    assert _digest(a) != _digest(b) and partition_id(a.spec) != partition_id(b.spec)


def test_original_protocol_class_counts_and_split():
    train_y = DATASETS["cifar100"][0]
    for setting in ("orig_iid", "orig_noniid", "orig_dir"):
        p = _make("cifar100", setting)
        held = [len(np.unique(train_y[t])) for t in p.train]
        assert held == [10, 30, 50, 70, 100]
        assert all(set(np.unique(train_y[te])) == set(np.unique(train_y[tr])) for tr, te in zip(p.train, p.test))
    p = _make("cifar10", "orig_iid")
    train_y = DATASETS["cifar10"][0]
    # IID inside the subsets: each class's 80 % pool split evenly over the clients holding it
    counts = _counts(p.train, train_y, 10)
    for c in range(10):
        have = counts[:, c][counts[:, c] > 0]
        assert have.max() - have.min() <= 1 and have.sum() == 4000
    assert sum(len(t) for t in p.train) == 40000 and sum(len(t) for t in p.test) == 10000


# ---------------------------------------------------------------------------------------------
# determinism, seeds, ids, persistence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
def test_same_seed_same_bytes_other_seed_differs(setting, tmp_path):
    a, b, c = _make("svhn", setting, 7), _make("svhn", setting, 7), _make("svhn", setting, 8)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)
    a.save(tmp_path / "p.npz")
    q = Partition.load(tmp_path / "p.npz")
    assert _digest(q) == _digest(a) and q.spec == a.spec and q.test_from == a.test_from


def test_validate_new_schemes_idempotent_and_ids_distinct():
    specs = fedhpl_specs(0.01, "classes", [2, 4, 6, 8, 10])
    ids = set()
    for spec in specs.values():
        v = validate_spec(spec)
        assert validate_spec(v) == v
        ids.add(partition_id(v))
    assert len(ids) == len(specs)
    # iid's new key is left out at its default, so an existing iid spec keeps its id and its file
    assert validate_spec({"scheme": "iid", "clients": 5, "min_per_class_frac": 0.0}) == \
        validate_spec({"scheme": "iid", "clients": 5})
    assert "min_per_class_frac" not in validate_spec({"scheme": "iid", "clients": 5})
    assert validate_spec(specs["iid"])["min_per_class_frac"] == 0.01
    assert validate_spec(specs["orig_iid"])["test_from"] == "train"


@pytest.mark.parametrize("change,message", [
    ({"scheme": "dirichlet_overlap", "alpha_sum": None}, "'alpha_sum' is needed"),
    ({"scheme": "dirichlet_overlap", "alpha_sum": "rows"}, r"'alpha_sum' must be one of \['classes', 'clients'\]"),
    ({"scheme": "dirichlet_overlap", "alpha": 0.5}, "'alpha_sum' only applies to alpha: random"),
    ({"scheme": "dirichlet_overlap", "test": "split"}, "'test' for scheme 'dirichlet_overlap'"),
    ({"scheme": "class_subsets", "classes_per_client": [2, 4]}, "one class count per client"),
    ({"scheme": "class_subsets", "classes_per_client": 4}, "non-empty list of integers"),
    ({"scheme": "class_subsets", "setting": "shards"}, r"'setting' must be one of \['iid'"),
    ({"scheme": "class_subsets", "setting": "iid"}, "do not apply to class_subsets with setting: iid"),
    ({"scheme": "class_subsets", "setting": "dirichlet", "alpha_sum": None, "alpha": None}, "needs key 'alpha'"),
    ({"scheme": "class_subsets", "setting": "dirichlet", "alpha": "random"}, "does not apply to setting: dirichlet"),
    ({"scheme": "class_subsets", "test": "full"}, r"'test' for scheme 'class_subsets' must be one of \['split'\]"),
])
def test_validate_new_schemes_clear_errors(change, message):
    base = {"clients": 5, "alpha": "random", "alpha_sum": "classes"}
    if change["scheme"] == "class_subsets":
        base = {**base, "classes_per_client": [2, 4, 6, 8, 10], "setting": "dirichlet_overlap"}
    spec = {k: v for k, v in {**base, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        validate_spec(spec)


def test_make_time_errors_name_the_problem():
    train_y, test_y = DATASETS["cifar10"][:2]
    with pytest.raises(ValueError, match="asks for 11 classes; the train split has 10"):
        make_partition({**_spec("cifar10", "orig_iid"), "classes_per_client": [2, 4, 6, 8, 11]}, 0, train_y, test_y)
    with pytest.raises(ValueError, match="min_per_class_frac=0.3 asks 1500 samples of class 0 for each of 5"):
        make_partition({**_spec("cifar10", "iid"), "min_per_class_frac": 0.3}, 0, train_y, test_y)
    with pytest.raises(ValueError, match="more than its share"):
        make_partition({**_spec("cifar10", "dir"), "min_per_class_frac": 0.3}, 0, train_y, test_y)


# ---------------------------------------------------------------------------------------------
# mini scale (embedded digits), heat maps, random parameters
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    from fedcore.data.embedded import build_embedded

    b = build_embedded("digits")
    return b.train.y, b.test.y


@pytest.mark.parametrize("pct,alpha_sum", [(0.01, "classes"), (0.10, "clients"), (0.005, "clients")])
def test_embedded_digits_all_settings(digits, pct, alpha_sum):
    train_y, test_y = digits
    for setting, spec in fedhpl_specs(pct, alpha_sum, [2, 4, 6, 8, 10]).items():
        check_invariants(make_partition(spec, 0, train_y, test_y), train_y, test_y)


def test_heatmap_draws_fedhpl_schemes(digits, tmp_path):
    train_y, test_y = digits
    setting = "orig_dir"  # overlapping counts and a private test set from the train split
    p = make_partition(fedhpl_specs(0.1, "clients", [2, 4, 6, 8, 10])[setting], 0, train_y, test_y)
    assert p.test_from == "train"
    df = class_counts(p, train_y, test_y)  # test counts read the train labels (test_from)
    png, pdf = tmp_path / "h.png", tmp_path / "h.pdf"
    plot_class_heatmap(df, png, pdf, f"digits {setting}", test_label="private test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert pdf.read_bytes()[:4] == b"%PDF" and pdf.stat().st_size > 1000


SMALL_TRAIN, SMALL_TEST = _labels([30, 45, 60, 25, 80, 50], 6), _labels([10, 15, 20, 8, 25, 16], 7)


@settings(max_examples=30, deadline=None)
@given(
    clients=st.integers(2, 6),
    setting=st.sampled_from(SETTINGS),
    pct=st.sampled_from([0.0, 0.02, 0.1]),
    alpha_sum=st.sampled_from(["classes", "clients"]),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
)
def test_invariants_for_random_parameters(clients, setting, pct, alpha_sum, data, seed):
    subsets = data.draw(st.lists(st.integers(1, 6), min_size=clients, max_size=clients))
    spec = {**fedhpl_specs(pct, alpha_sum, subsets)[setting], "clients": clients}
    check_invariants(make_partition(spec, seed, SMALL_TRAIN, SMALL_TEST), SMALL_TRAIN, SMALL_TEST)
