"""Our client partitions against the official samplers of SGPT, FedOTP and Fling (FedPFT's group), rule for rule.

Opt-in, one checkout per part (each part skips on its own without its variable; CI has no checkout and no internet):

    FEDPROMPT_SGPT_OFFICIAL=/tmp/sgpt_official       ubc-tea/SGPT           utils.py partition_data
    FEDPROMPT_FEDOTP_OFFICIAL=/tmp/fedotp_official   HongxiaLee/FedOTP      utils/datasplit.py, utils/data_utils.py,
                                                                            Dassl/.../base_dataset.py
    FEDPROMPT_FLING_OFFICIAL=/tmp/fling_official     FLAIR-Community/Fling  fling/utils/data_utils/sampling.py

    python -m pytest -n 0 tests/test_official_partitions.py

Their samplers are imported from the checkout at test time (nothing of them is copied here; stand-ins replace the
imports their partition code never calls) and run on synthetic labels of the papers' shapes (CIFAR-100: 500 train
and 100 test images per class, shuffled; Office-like domains; few-shot class lists), through fake dataset objects
their code accepts (a loader returning our arrays, FedBN-style pickles in a temp folder, Dassl ``Datum`` lists,
Fling's ``{'class_id': y}`` items).

Our schemes draw from ``np.random.default_rng``; theirs from numpy's legacy global state, ``RandomState`` or Python's
``random``. Where our draw makes the same kinds of random calls in the same order as theirs, the test hands our
scheme a small adapter that forwards each call to their stream (``LegacyStream``, ``PythonSampleStream``) or replays
their draws (``OfficeReplay``, ``QReplay``): with the same random numbers both sides must then give the SAME index
arrays, which proves that the rule from draws to partition is the same (the draws themselves are the same
distributions: uniform, Dirichlet, uniform permutations and samples). Where the call structure differs (FedOTP's
pachinko, Fling's pathological), every deterministic rule is asserted exactly and the per-client class-count
matrices are compared statistically (fixed seeds, tolerances stated at the constants). Documented differences
(DEVIATIONS.md, "Partitions" and "FedOTP data") are asserted as what they say.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import pickle
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

from fedcore.official_code import checkout_on_path, standin_modules
from fedcore.partition.class_order import prompt_class_names
from fedcore.partition.draw import largest_remainder
from fedcore.partition.make import make_partition
from fedcore.partition.registry import Labels
from fedcore.partition.schemes.domain import domain as domain_scheme
from fedcore.partition.schemes.fedotp import coarse_split, fewshot_pathological, office_label_images, pachinko
from fedcore.partition.schemes.label_skew import classes_per_client, dirichlet_per_client, pathological
from fedcore.partition.spec import validate_spec

SGPT_ENV, FEDOTP_ENV, FLING_ENV = "FEDPROMPT_SGPT_OFFICIAL", "FEDPROMPT_FEDOTP_OFFICIAL", "FEDPROMPT_FLING_OFFICIAL"
VERBOSE = bool(os.environ.get("FEDPROMPT_VERBOSE"))  # the statistics each statistical comparison saw (with -s)

K, TRAIN_PER_CLASS, TEST_PER_CLASS = 100, 500, 100   # CIFAR-100's shape
TRAIN_Y = np.random.default_rng(0).permutation(np.repeat(np.arange(K), TRAIN_PER_CLASS))
TEST_Y = np.random.default_rng(1).permutation(np.repeat(np.arange(K), TEST_PER_CLASS))
OFFICE_CLASSES = ["back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor", "mouse",
                  "mug", "projector"]   # FedBN's Office-Caltech10 class names, in label order (spec fedotp §3.1)


def _skip_without(env: str, what: str) -> pytest.MarkDecorator:
    """Skip a part unless ``env`` names a local checkout of ``what``."""
    return pytest.mark.skipif(not os.environ.get(env), reason=f"{env} is not set: it names a local checkout of "
                              f"github.com/{what} (none in CI, which has no internet)")


needs_sgpt = _skip_without(SGPT_ENV, "ubc-tea/SGPT")
needs_fedotp = _skip_without(FEDOTP_ENV, "HongxiaLee/FedOTP")
needs_fling = _skip_without(FLING_ENV, "FLAIR-Community/Fling")


def _root(env: str, marker: str) -> Path:
    """The checkout named by ``env``; fails (not skips) when it is not the expected repository."""
    root = Path(os.environ[env]).resolve()
    if not (root / marker).is_file():
        pytest.fail(f"{env}={root} is not the expected checkout (no {marker})")
    return root


def _load_file(path: Path, name: str) -> ModuleType:
    """One file of a checkout as a module that is never registered in sys.modules (so nothing of it leaks)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextmanager
def _global_streams(seed: int) -> Iterator[None]:
    """numpy's legacy global state and Python's ``random`` seeded for their code, restored afterwards."""
    np_state, py_state = np.random.get_state(), random.getstate()
    np.random.seed(seed)
    random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def _counts(lists: list[np.ndarray], y: np.ndarray, n_classes: int) -> np.ndarray:
    """Per-client class-count matrix (clients x classes)."""
    return np.stack([np.bincount(y[np.asarray(i, dtype=np.int64)], minlength=n_classes) for i in lists])


def _disjoint(lists: list[np.ndarray]) -> bool:
    """No index in two clients (nor twice in one)."""
    flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in lists])
    return len(flat) == len(np.unique(flat))


def _hhi(counts: np.ndarray) -> np.ndarray:
    """Each client's Herfindahl index of its class shares (sum of squared shares): how concentrated its labels are."""
    shares = counts / counts.sum(axis=1, keepdims=True)
    return (shares ** 2).sum(axis=1)


def _report(what: str, ours: float, theirs: float, tol: float) -> None:
    """A statistical comparison: print it with FEDPROMPT_VERBOSE, assert it within ``tol``."""
    if VERBOSE:
        print(f"{what}: ours {ours:.4f}, theirs {theirs:.4f}, |diff| {abs(ours - theirs):.4f} (tol {tol})")
    assert abs(ours - theirs) <= tol, f"{what}: ours {ours:.4f} vs theirs {theirs:.4f} (tol {tol})"


class LegacyStream:
    """Our scheme's rng calls forwarded to the streams SGPT's ``noniid-labeluni`` draws from: ``uniform`` and
    ``choice`` to numpy's legacy global state, ``permutation`` (their per-class ``random.shuffle``) to Python's."""

    def uniform(self, low: float, high: float, size: int) -> np.ndarray:
        """np.random.uniform, as their per-class alpha draw."""
        return np.random.uniform(low, high, size=size)

    def choice(self, a: np.ndarray) -> Any:
        """np.random.choice among the classes with the most shares left."""
        return np.random.choice(a)

    def permutation(self, a: np.ndarray) -> np.ndarray:
        """A copy of ``a`` shuffled in place by Python's random.shuffle."""
        out = np.array(a, copy=True)
        random.shuffle(out)
        return out


class PythonSampleStream:
    """Our few-shot draw's rng calls forwarded to Python's ``random`` (Dassl's generate_federated_fewshot_dataset):
    the class-list shuffle and one ``random.sample`` per owned class."""

    def permutation(self, a: np.ndarray) -> np.ndarray:
        """A copy of ``a`` shuffled by random.shuffle."""
        out = list(np.asarray(a).tolist())
        random.shuffle(out)
        return np.asarray(out, dtype=np.int64)

    def choice(self, pool: np.ndarray, size: int, replace: bool) -> np.ndarray:
        """random.sample of ``size`` pool entries (without replacement, as ours asks)."""
        assert not replace
        return np.asarray(random.sample(list(np.asarray(pool).tolist()), size), dtype=np.int64)


# =====================================================================================================================
# SGPT (and FedOTP's copy): noniid-labeluni = our classes_per_client
# =====================================================================================================================
@pytest.fixture(scope="module")
def sgpt() -> ModuleType:
    """SGPT's utils.py (partition_data); its dataset module is a stand-in (the loader is replaced per call)."""
    root = _root(SGPT_ENV, "utils.py")
    with checkout_on_path(root, ("utils", "datasets", "constants"),
                          standin_modules({"datasets": {"CIFAR100_truncated": None}})):
        mod = importlib.import_module("utils")
    assert Path(mod.__file__).resolve().is_relative_to(root)
    return mod


def _their_labeluni(module: ModuleType, extra: int, seed: int, **kwargs: Any) -> tuple[list, list]:
    """Their partition_data('noniid-labeluni') on TRAIN_Y / TEST_Y, seeded as their main script seeds it; their
    CIFAR-100 loader stood in (it returns ``extra`` more items than (X, y) of both splits)."""
    loader = module.load_cifar100_data
    module.load_cifar100_data = lambda datadir: (None, TRAIN_Y, None, TEST_Y, *([None] * extra))
    try:
        with _global_streams(seed):
            out = module.partition_data("cifar100", "unused", "noniid-labeluni", **kwargs)
    finally:
        module.load_cifar100_data = loader
    train, test = out[-4], out[-3]
    return [np.asarray(train[i]) for i in range(len(train))], [np.asarray(test[i]) for i in range(len(test))]


def _ours_labeluni(clients: int, s: int, seed: int) -> tuple[list, list]:
    """Our classes_per_client with every random call answered from their streams, seeded as theirs."""
    spec = validate_spec({"scheme": "classes_per_client", "clients": clients, "classes_per_client": s})
    with _global_streams(seed):
        return classes_per_client(spec, Labels(TRAIN_Y, TEST_Y), LegacyStream())


@needs_sgpt
@pytest.mark.parametrize("s", [10, 50])
def test_sgpt_labeluni_index_for_index(sgpt, s):
    """Claim: given the same random numbers, our classes_per_client IS SGPT's noniid-labeluni: the same client
    index arrays, in the same order, train and test (100 clients, s = 10 and 50: Table 1's settings)."""
    theirs = _their_labeluni(sgpt, 0, 0, n_parties=100, args=SimpleNamespace(cls_num=s))
    ours = _ours_labeluni(100, s, 0)
    for split, a, b in (("train", ours[0], theirs[0]), ("test", ours[1], theirs[1])):
        assert len(a) == len(b) == 100
        for i, (x, y) in enumerate(zip(a, b)):
            assert np.array_equal(x, y), f"{split} client {i} differs"
    # and the rule's consequences, on both: s classes each, disjoint, test shares follow the train shares
    tr = _counts(ours[0], TRAIN_Y, K)
    te = _counts(ours[1], TEST_Y, K)
    assert ((tr > 0).sum(axis=1) == s).all() and _disjoint(ours[0]) and _disjoint(ours[1])
    assert (np.abs(te - tr / 5) < 1).all()   # int(100 p) vs int(500 p) of the same p


@needs_sgpt
def test_sgpt_labeluni_make_partition_is_the_same_rule_on_our_generator(sgpt):
    """Claim: make_partition (our own generator) runs that same function: its partition equals the scheme's draw
    fed np.random.default_rng(seed), so the index-for-index proof above covers what the pipeline builds."""
    spec = {"scheme": "classes_per_client", "clients": 100, "classes_per_client": 10}
    p = make_partition(spec, 3, TRAIN_Y, TEST_Y)
    tr, te = classes_per_client(validate_spec(spec), Labels(TRAIN_Y, TEST_Y), np.random.default_rng(3))
    assert all(np.array_equal(a, b) for a, b in zip(p.train + p.test, tr + te))


# =====================================================================================================================
# FedOTP
# =====================================================================================================================
@pytest.fixture(scope="module")
def fedotp() -> SimpleNamespace:
    """FedOTP's utils/datasplit.py (its loaders stood in), utils/data_utils.py (torch stays real: it is installed)
    and Dassl's base_dataset.py (loaded alone, its Datum's file check and gdown stood in)."""
    root = _root(FEDOTP_ENV, "utils/datasplit.py")
    level = logging.getLogger().level
    loaders = {n: None for n in ("load_mnist_data", "load_fmnist_data", "load_cifar10_data", "load_cifar100_data",
                                 "load_svhn_data", "load_celeba_data", "load_femnist_data")}
    standins = standin_modules({"dataloader": loaders, "dataset": {"mkdirs": None},
                                "Dassl": {}, "Dassl.dassl": {}, "Dassl.dassl.utils": {"check_isfile": lambda p: True},
                                "gdown": {}})
    with checkout_on_path(root / "utils", ("datasplit", "dataloader", "dataset", "data_utils", "Dassl", "gdown"),
                          standins):
        datasplit = importlib.import_module("datasplit")
        data_utils = _load_file(root / "utils" / "data_utils.py", "fedotp_data_utils")
        base = _load_file(root / "Dassl" / "dassl" / "data" / "datasets" / "base_dataset.py", "fedotp_base_dataset")
    logging.getLogger().setLevel(level)   # datasplit sets the root logger to INFO on import
    assert Path(datasplit.__file__).resolve().is_relative_to(root)
    coarse = _coarse_map(datasplit)
    return SimpleNamespace(root=root, datasplit=datasplit, data_utils=data_utils, base=base, coarse=coarse)


def _their_datasplit(datasplit: ModuleType, partition: str, n_parties: int, beta: float = 0.4,
                     seed: int = 0) -> tuple[list, list]:
    """Their partition_data(dataset='cifar100', partition) on TRAIN_Y / TEST_Y; client lists (train, test)."""
    datasplit.load_cifar100_data = lambda datadir: (None, TRAIN_Y, None, TEST_Y, None, None, None, None)
    try:
        with _global_streams(seed):
            out = datasplit.partition_data("cifar100", "unused", partition, n_parties, beta=beta)
    finally:
        datasplit.load_cifar100_data = None
    train, test = out[4], out[5]
    return ([np.asarray(train[i], dtype=np.int64) for i in range(n_parties)],
            [np.asarray(test[i], dtype=np.int64) for i in range(n_parties)])


def _coarse_map(datasplit: ModuleType) -> np.ndarray:
    """CIFAR-100's fine -> coarse map as their code holds it, read off their iid-label100 split (client c holds the
    fine classes of coarse class c // 5), so that our coarse arrays are theirs without copying their table."""
    train, _ = _their_datasplit(datasplit, "iid-label100", 100)
    coarse = np.full(K, -1)
    for c, idx in enumerate(train):
        coarse[np.unique(TRAIN_Y[idx])] = c // 5
    assert (coarse >= 0).all() and (np.bincount(coarse) == 5).all()
    return coarse


@needs_fedotp
def test_fedotp_labeluni_is_sgpts_and_ours(fedotp):
    """Claim: FedOTP's noniid-labeluni (num hard-coded to 10 for CIFAR-100) is SGPT's: our classes_per_client
    reproduces it index for index as well."""
    theirs = _their_labeluni(fedotp.datasplit, 4, 5, n_parties=100)
    ours = _ours_labeluni(100, 10, 5)
    assert all(np.array_equal(a, b) for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]))


@needs_fedotp
def test_fedotp_iid_label100_equals_coarse_split(fedotp):
    """Claim: our coarse_split gives every client the same classes and counts as their iid-label100 (100 clients:
    client c holds the 5 fine classes of coarse class c // 5, 100 train and 20 test images of each, disjoint; the
    remainder of a class unused). The images are other random picks (their Python random.sample, our generator):
    the count matrices are deterministic and compared exactly."""
    theirs = _their_datasplit(fedotp.datasplit, "iid-label100", 100)
    labels = Labels(TRAIN_Y, TEST_Y, train_coarse=fedotp.coarse[TRAIN_Y], test_coarse=fedotp.coarse[TEST_Y])
    ours = coarse_split(validate_spec({"scheme": "coarse_split", "clients": 100}), labels, np.random.default_rng(0))
    for a, b, y in ((ours[0], theirs[0], TRAIN_Y), (ours[1], theirs[1], TEST_Y)):
        assert np.array_equal(_counts(a, y, K), _counts(b, y, K))
        assert _disjoint(a) and _disjoint(b)
    assert set(np.unique(_counts(ours[0], TRAIN_Y, K))) == {0, 100}
    assert set(np.unique(_counts(ours[1], TEST_Y, K))) == {0, 20}


@needs_fedotp
def test_fedotp_pachinko_rules_exact_and_class_mix_statistically(fedotp):
    """Claims. Exact, on both: every client draws 60000 // 100 = 600 samples of the pooled train+test set, disjoint
    over clients and covering it; an index below 50,000 is a train sample, else a test one. Statistical (their one
    draw, seed 12345 fixed in their code, vs ours at seeds 0, 1: 100 clients each): beta = 0.3, fine alpha 10. The
    mean over clients of the coarse-class Herfindahl index (E = 0.22 for Dir(0.3 1_20) before exhaustion), of the
    fine-within-coarse one and of the number of coarse classes held, and the spread of the train sizes (std over
    clients; the mean is 500 by construction) agree within the stated
    tolerances (several standard errors of the client means; a wrong alpha, fine alpha or pooling moves them by more).
    Why not index for index: their draws are np.random.multinomial picks plus Python's rng.choice per sample, ours
    inverse-CDF picks from one generator and a pre-shuffled pool."""
    theirs = _their_datasplit(fedotp.datasplit, "noniid-labeldir100", 100, beta=0.3)
    labels = Labels(TRAIN_Y, TEST_Y, train_coarse=fedotp.coarse[TRAIN_Y], test_coarse=fedotp.coarse[TEST_Y])
    spec = validate_spec({"scheme": "pachinko", "clients": 100, "alpha": 0.3, "fine_alpha": 10.0})
    ours = [pachinko(spec, labels, np.random.default_rng(seed)) for seed in (0, 1)]
    y_all = np.concatenate([TRAIN_Y, TEST_Y])

    def pooled(train: list, test: list) -> list[np.ndarray]:
        return [np.concatenate([a, b + len(TRAIN_Y)]) for a, b in zip(train, test)]

    stats, sizes = {}, {}
    for who, draws in (("theirs", [theirs]), ("ours", ours)):
        rows = []
        for train, test in draws:
            both = pooled(train, test)
            assert all(len(x) == 600 for x in both) and _disjoint(both)
            assert len(np.concatenate(both)) == len(y_all)                   # 100 x 600 = every sample
            assert all((a < len(TRAIN_Y)).all() and (b < len(TEST_Y)).all() for a, b in zip(train, test))
            fine = _counts(both, y_all, K)
            coarse = np.stack([np.bincount(fedotp.coarse, weights=row, minlength=20) for row in fine])
            within = []   # HHI of the fine classes inside each held coarse class, weighted by its size
            for row, crow in zip(fine, coarse):
                shares = [((row[fedotp.coarse == c] / crow[c]) ** 2).sum() * crow[c] for c in range(20) if crow[c]]
                within.append(sum(shares) / crow.sum())
            rows.append(np.column_stack([_hhi(coarse), within, (coarse > 0).sum(axis=1)]))
            sizes.setdefault(who, []).extend(len(a) for a in train)
        stats[who] = [*np.concatenate(rows).mean(axis=0), np.std(sizes[who])]
    for j, (what, tol) in enumerate((("coarse HHI", 0.04), ("fine-within-coarse HHI", 0.01),
                                     ("coarse classes held", 1.0), ("std of the train size", 2.5))):
        _report(f"pachinko {what}", stats["ours"][j], stats["theirs"][j], tol)


def _datum_source(base: ModuleType, y: np.ndarray) -> list:
    """Their Datum list of a split (impath = our index, as text), listed class by class and by our index within a
    class: their sampler visits the classes in the order they first appear in the list (ours in label order) and
    samples from a class's items in list order (ours from its indices in index order)."""
    return [base.Datum(impath=str(i), label=int(y[i]), domain=0, classname=str(y[i]))
            for i in np.argsort(y, kind="stable")]


@needs_fedotp
@pytest.mark.parametrize("n_cls,shots", [(37, 2), (47, 16), (102, 1)])   # OxfordPets, DTD, Flowers102 (N = 10)
def test_fedotp_fewshot_index_for_index(fedotp, n_cls, shots):
    """Claim: given the same Python random stream (their random.seed(2023)), our fewshot_pathological IS their
    generate_federated_fewshot_dataset (train) + generate_federated_dataset (test, non-IID): the same class blocks
    (round(K/N) each, the last client the rest), the same `shots` images per owned class and every test image of
    the owned classes. (Their Datum list is given class by class, see _datum_source: which images their
    random.sample picks depends on the list's order, as ours on the index order.)"""
    rng = np.random.default_rng(n_cls)
    train_y = rng.permutation(np.repeat(np.arange(n_cls), 20))
    test_y = rng.permutation(np.repeat(np.arange(n_cls), 7))
    ds = fedotp.base.DatasetBase.__new__(fedotp.base.DatasetBase)
    with _global_streams(2023):
        their_train = ds.generate_federated_fewshot_dataset(_datum_source(fedotp.base, train_y), num_shots=shots,
                                                            num_users=10, is_iid=False)
        their_test = ds.generate_federated_dataset(_datum_source(fedotp.base, test_y), num_shots=shots,
                                                   num_users=10, is_iid=False)
    spec = validate_spec({"scheme": "fewshot_pathological", "clients": 10, "shots": shots})
    with _global_streams(2023):
        ours = fewshot_pathological(spec, Labels(train_y, test_y), PythonSampleStream())
    blocks = []
    for i in range(10):
        theirs_tr = np.sort([int(d.impath) for d in their_train[i]])
        theirs_te = np.sort([int(d.impath) for d in their_test[i]])
        assert np.array_equal(np.sort(ours[0][i]), theirs_tr), f"train of client {i}"
        assert np.array_equal(np.sort(ours[1][i]), theirs_te), f"test of client {i}"
        blocks.append(len(np.unique(train_y[theirs_tr])))
    per = round(n_cls / 10)
    assert blocks == [per] * 9 + [n_cls - 9 * per]


# ---- Office feature & label shift: Dataset_partition_office = our scheme `domain` with alpha ------------------------
SITES = ("amazon", "caltech", "dslr", "webcam")
OFFICE_PER_CLASS = {"amazon": (70, 19), "caltech": (80, 22), "dslr": (12, 3), "webcam": (24, 6)}   # ~FedBN's sizes


def _office(tmp: Path) -> SimpleNamespace:
    """An Office-like bundle (10 classes, 4 domains, class-balanced up to +-20 %, shuffled file order) as our label
    arrays (domains contiguous, in site order) and as FedBN pickles (paths, text labels) their code reads."""
    rng = np.random.default_rng(7)
    (tmp / "office_caltech_10").mkdir()
    arrays: dict[str, list] = {"train_y": [], "test_y": [], "train_d": [], "test_d": []}
    for d, site in enumerate(SITES):
        for split, n in zip(("train", "test"), OFFICE_PER_CLASS[site]):
            y = rng.permutation(np.concatenate([np.full(int(n * rng.uniform(0.8, 1.2)), c) for c in range(10)]))
            paths = np.array([f"{site}/{split}/{i}.jpg" for i in range(len(y))])
            with open(tmp / "office_caltech_10" / f"{site}_{split}.pkl", "wb") as f:
                pickle.dump((paths, np.array([OFFICE_CLASSES[c] for c in y])), f)
            arrays[f"{split}_y"].append(y)
            arrays[f"{split}_d"].append(np.full(len(y), d))
    return SimpleNamespace(**{k: np.concatenate(v) for k, v in arrays.items()})


class OfficeReplay:
    """Replays Dataset_partition_office's draws into our domain_dirichlet: per (domain, class), in our order, the
    code's np.random.seed(0), shuffles of the class's train and test positions and Dirichlet proportions; our
    ``dirichlet`` gets those proportions and our two ``permutation`` calls those shuffles (as global indices)."""

    def __init__(self, office: SimpleNamespace, beta: float, k: int) -> None:
        self.beta, self.k, self.queue = beta, k, []
        self.steps = iter([(d, c) for d in np.unique(office.train_d)
                           for c in np.unique(office.train_y[office.train_d == d])])
        self.office = office

    def dirichlet(self, alpha: np.ndarray) -> np.ndarray:
        """Their proportions of the next (domain, class); queues their two shuffles for our permutations."""
        assert np.allclose(alpha, self.beta) and len(alpha) == self.k
        d, c = next(self.steps)
        o = self.office
        tr_off, te_off = np.flatnonzero(o.train_d == d)[0], np.flatnonzero(o.test_d == d)[0]
        tr = np.where(o.train_y[o.train_d == d] == c)[0]
        te = np.where(o.test_y[o.test_d == d] == c)[0]
        state = np.random.get_state()
        np.random.seed(0)
        np.random.shuffle(tr)
        np.random.shuffle(te)
        p = np.random.dirichlet(np.repeat(self.beta, self.k))
        np.random.set_state(state)
        self.queue = [tr + tr_off, te + te_off]
        return p

    def permutation(self, pool: np.ndarray) -> np.ndarray:
        """Their shuffle of this pool (the train one first, then the test one)."""
        out = self.queue.pop(0)
        assert np.array_equal(np.sort(out), np.sort(pool))
        return out


def _their_office(data_utils: ModuleType, base: Path, beta: float, k: int) -> list[tuple[dict, dict]]:
    """Their (train map, test map) of every site, in site order (positions inside the site's pickles)."""
    state = np.random.get_state()
    try:
        return [data_utils.Dataset_partition_office(str(base), site, beta, n_parties=k, min_require_size=2)
                for site in SITES]
    finally:
        np.random.set_state(state)


@needs_fedotp
def test_fedotp_office_dirichlet_index_for_index_and_label_bug(fedotp, tmp_path, capsys):
    """Claims. (1) Given the same draws (their np.random.seed(0) per class), our scheme `domain` with alpha 0.1 and
    3 clients per domain IS their Dataset_partition_office: the same index sets per client, train and test (Dir
    cuts of the shuffled class pools by floor of the cumulative shares, the same proportions for train and test, the
    balance mask N_train / 3 on train sizes). Their per-client shuffle is left out (ours are sorted). (2) Our
    bug_compat_office_labels reproduces their OfficeDataset_sub: client i shows the first n images of its domain's
    pickle, with the labels of its partition indices (the same image set and label multiset per client; which
    image meets which label is a random pairing on both sides)."""
    office = _office(tmp_path)
    labels = Labels(office.train_y, office.test_y, train_domain=office.train_d, test_domain=office.test_d)
    spec = validate_spec({"scheme": "domain", "clients_per_domain": 3, "alpha": 0.1})
    ours = domain_scheme(spec, labels, OfficeReplay(office, 0.1, 3))   # no redraw: one replay per (domain, class)
    theirs = _their_office(fedotp.data_utils, tmp_path, 0.1, 3)
    capsys.readouterr()   # their class-count prints
    offsets = {split: [np.flatnonzero(getattr(office, f"{split}_d") == d)[0] for d in range(4)]
               for split in ("train", "test")}
    for d, (tr_map, te_map) in enumerate(theirs):
        for j in range(3):
            i = 3 * d + j
            assert np.array_equal(ours[0][i], np.sort(np.asarray(tr_map[j]) + offsets["train"][d])), f"train {i}"
            assert np.array_equal(ours[1][i], np.sort(np.asarray(te_map[j]) + offsets["test"][d])), f"test {i}"
    # (2) the image/label misalignment
    rng = np.random.default_rng(0)
    for split, y, dom in (("train", office.train_y, office.train_d), ("test", office.test_y, office.test_d)):
        shown = office_label_images(ours[0] if split == "train" else ours[1], dom, rng)
        for d, maps in enumerate(theirs):
            for j in range(3):
                i = 3 * d + j
                their_map = maps[0 if split == "train" else 1][j]
                sub = fedotp.data_utils.OfficeDataset_sub(str(tmp_path), SITES[d], their_map, train=split == "train")
                their_images = sorted(int(Path(x.impath).stem) for x in sub.data_detailed)
                their_labels = sorted(x.label for x in sub.data_detailed)
                idx = (ours[0] if split == "train" else ours[1])[i]
                assert sorted((shown[i] - offsets[split][d]).tolist()) == their_images == list(range(len(idx)))
                assert sorted(y[idx].tolist()) == their_labels
    capsys.readouterr()


_CLASSNAMES_PROBE = """
import json, pickle, sys, types, importlib.util
root, base = sys.argv[1], sys.argv[2]
for name, attrs in {"torch": {}, "torch.utils": {}, "torch.utils.data": {"Dataset": object}, "torchvision": {},
                    "torchvision.transforms": {}, "PIL": {}, "PIL.Image": {}}.items():
    sys.modules[name] = types.ModuleType(name); sys.modules[name].__dict__.update(attrs)
sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
sys.modules["PIL"].Image = sys.modules["PIL.Image"]
spec = importlib.util.spec_from_file_location("their_data_utils", root + "/utils/data_utils.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
ds = mod.OfficeDataset(base, "amazon", train=False)
print(json.dumps({"classnames": list(ds.classnames), "lab2cname": ds.lab2cname}))
"""


@needs_fedotp
def test_fedotp_classname_order_bug(fedotp, tmp_path):
    """Claim: their Office class names come from a Python set: the list their prompts are written from is a
    permutation of the label-ordered names that changes with the process's hash seed (run here in 3 processes,
    PYTHONHASHSEED 0, 1, 2; torch/PIL stood in, since the class is only constructed). Our
    bug_compat_classname_order is one such permutation, fixed by the partition seed: prompt k gets
    names[class_order[k]]; and their pairing of any process is expressible as a class_order."""
    _office(tmp_path)
    seen = []
    for h in range(3):
        out = subprocess.run([sys.executable, "-c", _CLASSNAMES_PROBE, str(fedotp.root), str(tmp_path)],
                             env={**os.environ, "PYTHONHASHSEED": str(h)}, capture_output=True, text=True, check=True)
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for s in seen:
        assert sorted(s["classnames"]) == sorted(OFFICE_CLASSES)
        assert sorted(s["lab2cname"], key=s["lab2cname"].get) == OFFICE_CLASSES   # labels follow the listed order
    orders = {tuple(s["classnames"]) for s in seen}
    assert len(orders) > 1, "the set's order did not change with the hash seed"
    assert any(list(o) != OFFICE_CLASSES for o in orders)
    spec = {"scheme": "domain", "bug_compat_classname_order": True}
    y = np.repeat(np.arange(10), 4)
    p1 = make_partition(spec, 0, y, y, np.zeros(40, dtype=np.int64), np.zeros(40, dtype=np.int64))
    p2 = make_partition(spec, 0, y, y, np.zeros(40, dtype=np.int64), np.zeros(40, dtype=np.int64))
    assert np.array_equal(p1.class_order, p2.class_order)                     # reproducible, unlike theirs
    assert sorted(p1.class_order.tolist()) == list(range(10)) and p1.class_order.tolist() != list(range(10))
    names = prompt_class_names(OFFICE_CLASSES, p1.class_order)
    assert names == [OFFICE_CLASSES[j] for j in p1.class_order]
    for s in seen:   # theirs as a class_order: prompt k is written with their k-th listed name
        order = np.array([OFFICE_CLASSES.index(n) for n in s["classnames"]])
        assert prompt_class_names(OFFICE_CLASSES, order) == s["classnames"]


# =====================================================================================================================
# Fling (FedPFT's group): dirichlet_sampling = our dirichlet_per_client, pathological_sampling = our pathological
# =====================================================================================================================
@pytest.fixture(scope="module")
def fling() -> ModuleType:
    """Fling's fling/utils/data_utils/sampling.py, loaded alone (its package __init__ pulls the whole framework)."""
    root = _root(FLING_ENV, "fling/utils/data_utils/sampling.py")
    return _load_file(root / "fling" / "utils" / "data_utils" / "sampling.py", "fling_sampling")


def _items(y: np.ndarray) -> list[dict]:
    """A Fling dataset of these labels (their samplers read item['class_id'])."""
    return [{"class_id": int(c)} for c in y]


TRAIN_ITEMS, TEST_ITEMS = _items(TRAIN_Y), _items(TEST_Y)


def _fling(fn: Any, seed: int, clients: int, train_num: int, test_num: int, items: tuple | None = None,
           **kw: Any) -> tuple[list, list]:
    """Their sampler on train and test (default: CIFAR-100's shape), with the same seed, as data_sampling calls it;
    (train, test) index lists."""
    tr_items, te_items = items or (TRAIN_ITEMS, TEST_ITEMS)
    tr = fn(tr_items, clients, train_num, seed, **kw)
    te = fn(te_items, clients, test_num, seed, **kw)
    return [np.asarray(d.indexes, dtype=np.int64) for d in tr], [np.asarray(d.indexes, dtype=np.int64) for d in te]


class QReplay:
    """Our dirichlet_per_client's draws with Fling's q: ``dirichlet`` returns their q's next row, ``choice`` is
    our own generator's."""

    def __init__(self, q: np.ndarray) -> None:
        self.rows, self.rng = iter(q), np.random.default_rng(0)

    def dirichlet(self, alpha: np.ndarray) -> np.ndarray:
        """Their next client's class proportions."""
        return next(self.rows)

    def choice(self, *args: Any, **kw: Any) -> np.ndarray:
        """Our generator's sample."""
        return self.rng.choice(*args, **kw)


def _fling_counts(q: np.ndarray, total: int) -> np.ndarray:
    """Fling's count rule as documented (DEVIATIONS.md): int(total q_j + 0.5) for every class but the last, capped
    at what is left of the total; the last class takes the rest."""
    out = np.zeros_like(q, dtype=np.int64)
    for i, row in enumerate(q):
        left = total
        for j, x in enumerate(row):
            n = int(total * x + 0.5) if j < len(row) - 1 else left
            out[i, j] = max(min(n, left), 0)
            left -= out[i, j]
    return out


@needs_fling
@pytest.mark.parametrize("alpha", [0.1, 0.5])
def test_fling_dirichlet_counts_same_q_and_the_documented_rounding(fling, alpha):
    """Claims, given their q (RandomState(seed).dirichlet(alpha 1_100, 40), their first draw): (a) their counts
    follow the rule DEVIATIONS.md states (int(500 q + 0.5), capped, the last class the rest: totals exactly 500 and
    100), ours are largest-remainder counts of the same q: the documented difference; every class but the last
    differs by at most 1, the last by what their rounding left over (printed); (b) on both, a client's test counts
    come from the same q as its train counts (Fling: the same seed), sampling is without replacement within a
    client and independent across clients (overlap between clients occurs on both)."""
    seed = 4
    theirs = _fling(fling.dirichlet_sampling, seed, 40, 500, 100, alpha=alpha)
    q = np.random.RandomState(seed).dirichlet(np.repeat(alpha, K), 40)
    spec = validate_spec({"scheme": "dirichlet_per_client", "clients": 40, "alpha": alpha, "train_per_client": 500,
                          "test_per_client": 100})
    ours = dirichlet_per_client(spec, Labels(TRAIN_Y, TEST_Y), QReplay(q))
    worst_last = 0
    for split, total, y, o, t in (("train", 500, TRAIN_Y, ours[0], theirs[0]),
                                  ("test", 100, TEST_Y, ours[1], theirs[1])):
        oc, tc = _counts(o, y, K), _counts(t, y, K)
        assert np.array_equal(tc, _fling_counts(q, total)), f"Fling's {split} counts are not the documented rule"
        assert np.array_equal(oc, np.stack([largest_remainder(row, total) for row in q]))
        assert (oc.sum(axis=1) == total).all() and (tc.sum(axis=1) == total).all()
        capped = np.cumsum(tc, axis=1) >= total        # from here on their budget is spent (cap binds)
        body = ~capped[:, :-1] | (tc[:, :-1] > 0)
        assert (np.abs(oc - tc)[:, :-1][body] <= 1).all()
        worst_last = max(worst_last, int(np.abs(oc - tc)[:, -1].max()))
        for side in (o, t):
            assert all(len(np.unique(x)) == len(x) for x in side)                  # none twice within a client
            assert not _disjoint(side)                                           # overlap across clients
    if VERBOSE:
        print(f"alpha {alpha}: largest |ours - Fling| of the last class's count: {worst_last}")


@needs_fling
def test_fling_dirichlet_class_mix_statistically(fling):
    """Claim: with each side's own generator (Fling seeds 0-4, ours 0-4: 200 clients each), alpha 0.1 and 0.5,
    the clients' train class mix has the same distribution: mean Herfindahl index (E = (alpha + 1) / (100 alpha +
    1)) and mean number of classes held agree within the stated tolerances."""
    for alpha, tol_hhi, tol_held in ((0.1, 0.02, 1.5), (0.5, 0.005, 1.5)):
        stats = {}
        spec = validate_spec({"scheme": "dirichlet_per_client", "clients": 40, "alpha": alpha,
                              "train_per_client": 500, "test_per_client": 100})
        for who in ("theirs", "ours"):
            mats = []
            for seed in range(5):
                if who == "theirs":
                    tr = [np.asarray(d.indexes, dtype=np.int64) for d in
                          fling.dirichlet_sampling(TRAIN_ITEMS, 40, 500, seed, alpha=alpha)]
                else:
                    tr = dirichlet_per_client(spec, Labels(TRAIN_Y, TEST_Y), np.random.default_rng(seed))[0]
                mats.append(_counts(tr, TRAIN_Y, K))
            c = np.concatenate(mats)
            stats[who] = (_hhi(c).mean(), (c > 0).sum(axis=1).mean())
        _report(f"dirichlet alpha {alpha} HHI", stats["ours"][0], stats["theirs"][0], tol_hhi)
        _report(f"dirichlet alpha {alpha} classes held", stats["ours"][1], stats["theirs"][1], tol_held)


@needs_fling
@pytest.mark.parametrize("shape", ["cifar100", "cifar10"])
def test_fling_pathological_rules_and_documented_overlap(fling, shape):
    """Claims. Exact, on both (FedPFT's CIFAR-100 setting: 40 clients x 20 classes x int(500/20) = 25 train and
    int(100/20) = 5 test; CIFAR-10: 2 classes x 250 / 50): every client holds exactly that many distinct classes
    with exactly those counts, the same classes in train and test, no index twice within a client. Statistical:
    the classes are uniform random subsets on both (each class's share of the picks over seeds 0-4 within 4.5
    binomial standard errors of 1/k). Documented difference (DEVIATIONS.md, Partitions): ours
    hands out a class's samples disjointly across clients until its pool runs dry, Fling samples each client
    independently (overlap between clients from the start)."""
    if shape == "cifar100":
        k, s, train_y, test_y, tr_items, te_items = K, 20, TRAIN_Y, TEST_Y, TRAIN_ITEMS, TEST_ITEMS
    else:   # CIFAR-10's shape: 10 classes of 5000 / 1000
        k, s = 10, 2
        train_y = np.random.default_rng(2).permutation(np.repeat(np.arange(10), 5000))
        test_y = np.random.default_rng(3).permutation(np.repeat(np.arange(10), 1000))
        tr_items, te_items = _items(train_y), _items(test_y)
    n_tr, n_te = int(500 / s), int(100 / s)
    spec = validate_spec({"scheme": "pathological", "clients": 40, "classes_per_client": s, "train_per_class": n_tr,
                          "test_per_class": n_te})
    picks = {"ours": np.zeros(k), "theirs": np.zeros(k)}
    overlap = {"ours": 0, "theirs": 0}
    for seed in range(5):
        theirs = _fling(fling.pathological_sampling, seed, 40, 500, 100, alpha=s, items=(tr_items, te_items))
        ours = pathological(spec, Labels(train_y, test_y), np.random.default_rng(seed))
        for who, (tr, te) in (("ours", ours), ("theirs", theirs)):
            tc, ec = _counts(tr, train_y, k), _counts(te, test_y, k)
            assert ((tc > 0).sum(axis=1) == s).all() and set(np.unique(tc)) == {0, n_tr}
            assert set(np.unique(ec)) == {0, n_te} and np.array_equal(tc > 0, ec > 0)
            assert all(len(np.unique(x)) == len(x) for x in tr + te)
            picks[who] += (tc > 0).sum(axis=0)
            overlap[who] += sum(len(x) for x in tr) - len(np.unique(np.concatenate(tr)))
    # 40 clients x s picks of k classes per seed: each class is held by 40 s / k clients on average
    for who in picks:   # each class's share of all picks: uniform within 4.5 binomial standard errors
        share, sigma = picks[who] / picks[who].sum(), np.sqrt((1 / k) * (1 - 1 / k) / picks[who].sum())
        if VERBOSE:
            print(f"{shape} {who}: largest |class share - 1/k| {np.abs(share - 1 / k).max() / sigma:.2f} sigma")
        assert np.abs(share - 1 / k).max() < 4.5 * sigma, f"{who}: classes not uniform"
    # the documented difference: 40 x s x n_tr / k = 200 (C100) / 2000 (C10) samples asked of a 500 / 5000 pool
    assert overlap["ours"] == 0 and overlap["theirs"] > 0
    if VERBOSE:
        print(f"{shape}: Fling's repeated train samples across clients over 5 seeds: {overlap['theirs']}; ours 0")
