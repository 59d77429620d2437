"""Property tests of FedOTP's partitions (spec fedotp §3.2, §8.1, §8.2, §8.20) and the official code's data bugs.

Synthetic labels with the class counts of the paper's datasets (CoOp splits, CIFAR-100 with its coarse classes,
Office-Caltech10's 4 domains) plus the embedded digits of the mini scale.
"""
from __future__ import annotations

import numpy as np
import pytest

from fedcore.data.embedded import build_embedded
from fedcore.data.facts import dataset_facts
from fedcore.partition.file import Partition
from fedcore.partition.make import make_partition
from fedcore.partition.spec import partition_id, spec_limits, validate_spec
from fedcore.partition.class_order import classname_order
from fedcore.partition.schemes.fedotp import fewshot_blocks


def _labels(per_class: list[int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(len(per_class)), per_class))


def _cifar100_like(train_per: int = 50, test_per: int = 10):
    """100 fine classes, coarse = fine // 5 (20 coarse classes of 5 fine ones), reduced sizes."""
    tr, te = _labels([train_per] * 100, 0), _labels([test_per] * 100, 1)
    return tr, te, tr // 5, te // 5


# ---- fewshot_pathological (§3.2a) ---------------------------------------------------------------
@pytest.mark.parametrize("k,sizes", [(100, [10] * 10), (102, [10] * 9 + [12]), (37, [4] * 9 + [1]),
                                     (47, [5] * 9 + [2]), (101, [10] * 9 + [11])])
def test_fewshot_class_blocks_match_the_code(k, sizes):
    """Caltech101, Flowers102, OxfordPets, DTD, Food101 over 10 clients: the counts spec §3.2a lists."""
    assert [b - a for a, b in fewshot_blocks(k, 10)] == sizes
    tr, te = _labels([20] * k, 2), _labels([7] * k, 3)
    p = make_partition({"scheme": "fewshot_pathological", "clients": 10, "shots": 4}, 2023, tr, te)
    owned = [np.unique(tr[t]) for t in p.train]
    assert [len(o) for o in owned] == sizes
    flat = np.concatenate(owned)
    assert len(flat) == len(np.unique(flat)) == k  # disjoint blocks covering every class
    for o, t, s in zip(owned, p.train, p.test):
        assert np.array_equal(np.bincount(tr[t], minlength=k)[o], np.full(len(o), 4))  # exactly `shots` each
        assert np.array_equal(np.sort(s), np.flatnonzero(np.isin(te, o)))  # all test images of its classes


def test_fewshot_errors_and_limits():
    with pytest.raises(ValueError, match="without a class"):
        fewshot_blocks(10, 6)  # round(10/6) = 2: five clients take all 10 classes, the sixth none
    tr, te = _labels([3] * 10, 0), _labels([2] * 10, 1)
    with pytest.raises(ValueError, match="shots=4 exceeds the 3 train images"):
        make_partition({"scheme": "fewshot_pathological", "clients": 2, "shots": 4}, 0, tr, te)
    spec = validate_spec({"scheme": "fewshot_pathological", "clients": 10, "shots": 20})
    bad = spec_limits(spec, dataset_facts("digits_five"), "digits_five")  # smallest class: 18 train images
    assert bad and bad[0].key == "partition.shots"
    bad = spec_limits(validate_spec({"scheme": "fewshot_pathological", "clients": 6, "shots": 1}),
                      dataset_facts("digits"), "digits")
    assert bad and bad[0].key == "partition.clients"


def test_fixed_seed_makes_the_partition_independent_of_the_run_seed():
    tr, te = _labels([20] * 37, 0), _labels([5] * 37, 1)
    spec = {"scheme": "fewshot_pathological", "clients": 10, "shots": 2, "fixed_seed": 2023}
    a, b = make_partition(spec, 0, tr, te), make_partition(spec, 1, tr, te)
    assert a.seed == b.seed == 2023
    assert all(np.array_equal(x, y) for x, y in zip(a.train + a.test, b.train + b.test))
    free = {k: v for k, v in spec.items() if k != "fixed_seed"}
    c, d = make_partition(free, 0, tr, te), make_partition(free, 1, tr, te)
    assert any(not np.array_equal(x, y) for x, y in zip(c.train, d.train))
    # the default (no fixed seed) leaves the spec, hence the id and file of older partitions, unchanged
    assert "fixed_seed" not in validate_spec({"scheme": "iid", "clients": 3})


# ---- pachinko (§3.2b) ---------------------------------------------------------------------------
def test_pachinko_sizes_disjoint_and_train_test_from_one_pool():
    tr, te, ctr, cte = _cifar100_like()
    spec = {"scheme": "pachinko", "clients": 10, "alpha": 0.3}
    p = make_partition(spec, 12345, tr, te, train_coarse=ctr, test_coarse=cte)
    assert p.num_clients == 10
    per = (len(tr) + len(te)) // 10
    assert [len(a) + len(b) for a, b in zip(p.train, p.test)] == [per] * 10
    pooled = np.concatenate([np.concatenate(p.train), np.concatenate(p.test) + len(tr)])
    assert len(pooled) == len(np.unique(pooled))  # without replacement over all clients
    # a small coarse alpha skews the coarse mix far more than alpha = 100 (the test follows the train draw)
    def coarse_spread(alpha):
        q = make_partition({**spec, "alpha": alpha}, 1, tr, te, train_coarse=ctr, test_coarse=cte)
        return np.mean([len(np.unique(ctr[t])) for t in q.train])
    assert coarse_spread(0.1) < coarse_spread(100.0) - 5


def test_pachinko_needs_coarse_labels_that_nest():
    tr, te, ctr, cte = _cifar100_like(5, 2)
    spec = {"scheme": "pachinko", "clients": 4, "alpha": 1.0}
    with pytest.raises(ValueError, match="needs coarse labels"):
        make_partition(spec, 0, tr, te)
    with pytest.raises(ValueError, match="several coarse classes"):
        make_partition(spec, 0, tr, te, train_coarse=ctr, test_coarse=(cte + 1) % 20)
    assert spec_limits(validate_spec(spec), dataset_facts("digits_styles4"), "digits_styles4")[0].key == \
        "partition.scheme"


# ---- coarse_split (§3.2e) -----------------------------------------------------------------------
def test_coarse_split_cifar100_counts():
    """100 clients, 20 coarse classes: client c holds coarse c // 5 and 100 train / 20 test of each of its 5
    fine classes (the code's (50000/100)//5 and (10000/100)//5)."""
    tr, te, ctr, cte = _cifar100_like(500, 100)
    p = make_partition({"scheme": "coarse_split", "clients": 100}, 12345, tr, te, train_coarse=ctr,
                       test_coarse=cte)
    for c, (a, b) in enumerate(zip(p.train, p.test)):
        assert set(ctr[a]) == set(cte[b]) == {c // 5}
        assert np.array_equal(np.bincount(tr[a], minlength=100)[5 * (c // 5):5 * (c // 5) + 5], [100] * 5)
        assert np.array_equal(np.bincount(te[b], minlength=100)[5 * (c // 5):5 * (c // 5) + 5], [20] * 5)
    assert len(np.unique(np.concatenate(p.train))) == 50000
    with pytest.raises(ValueError, match="multiple of the 20 coarse"):
        make_partition({"scheme": "coarse_split", "clients": 30}, 0, tr, te, train_coarse=ctr, test_coarse=cte)


def test_coarse_split_and_pachinko_on_mini_digits():
    b = build_embedded("digits")
    args = (b.train.y, b.test.y, None, None, b.train.coarse, b.test.coarse)
    p = make_partition({"scheme": "coarse_split", "clients": 10}, 0, *args)
    assert [set(b.train.coarse[t]) for t in p.train] == [{c // 2} for c in range(10)]
    q = make_partition({"scheme": "pachinko", "clients": 10, "alpha": 0.1}, 0, *args)
    assert sum(len(t) for t in q.train + q.test) == (len(b.train) + len(b.test)) // 10 * 10


# ---- Office feature & label shift (§3.2d) -------------------------------------------------------
def _office_like():
    rng = np.random.default_rng(4)
    tr_dom, te_dom = np.repeat([0, 1, 2, 3], [400, 500, 120, 230]), np.repeat([0, 1, 2, 3], [100, 120, 30, 60])
    return rng.integers(0, 10, len(tr_dom)), rng.integers(0, 10, len(te_dom)), tr_dom, te_dom


def test_domain_dirichlet_three_clients_per_domain_same_proportions():
    tr, te, trd, ted = _office_like()
    spec = {"scheme": "domain", "clients_per_domain": 3, "alpha": 0.1, "fixed_seed": 0}
    p = make_partition(spec, 5, tr, te, trd, ted)
    assert p.num_clients == 12
    for c, (a, b) in enumerate(zip(p.train, p.test)):
        assert set(trd[a]) == {c // 3} and set(ted[b]) <= {c // 3}
        assert len(a) >= 2
    for d in range(4):  # each domain's pools are split completely and disjointly
        mine = np.concatenate(p.train[3 * d:3 * d + 3])
        assert np.array_equal(np.sort(mine), np.flatnonzero(trd == d))
    # alpha = 0.1 makes label-skewed clients: most clients miss some classes of their domain
    assert np.mean([len(np.unique(tr[a])) for a in p.train]) < 8
    # the same Dirichlet draw cuts train and test of a class: shares agree up to rounding
    for d in range(4):
        for cls in range(10):
            ntr = np.array([np.sum(tr[a] == cls) for a in p.train[3 * d:3 * d + 3]])
            nte = np.array([np.sum(te[b] == cls) for b in p.test[3 * d:3 * d + 3]])
            if ntr.sum() >= 20 and nte.sum() >= 20:
                assert np.abs(ntr / ntr.sum() - nte / nte.sum()).max() < 0.15


def test_domain_dirichlet_masks_clients_past_their_share_and_keeps_min_size_in_test_too():
    """The code's balance mask (Dataset_partition_office): once a client holds its share N_train / k of the domain's
    train samples it gets nothing of the later classes; every client has min_size train and test samples."""
    from fedcore.partition.schemes.fedotp import domain_dirichlet

    y = np.repeat(np.arange(10), 30)                               # one domain, 10 classes of 30
    dom = np.zeros(len(y), dtype=int)
    ty = np.repeat(np.arange(10), 6)
    tdom = np.zeros(len(ty), dtype=int)
    for seed in range(5):
        tr, te = domain_dirichlet(0.1, 2, 3, y, ty, dom, tdom, np.random.default_rng(seed))
        assert min(map(len, tr + te)) >= 2
        # replay the class order: a client already past 100 = 300 / 3 never gets a later class
        held = np.zeros(3)
        for c in range(10):
            got = np.array([np.sum(y[t] == c) for t in tr])
            assert not np.any((held >= 100) & (got > 0)), (seed, c)
            held += got


def test_domain_without_alpha_is_unchanged_and_rejects_alpha_only_keys():
    assert validate_spec({"scheme": "domain"}) == {"scheme": "domain", "clients_per_domain": 1,
                                                  "train_fraction_of_min": None, "equal_test_size": False,
                                                  "test": "domain", "test_from": "test"}
    with pytest.raises(ValueError, match="applies only with 'alpha'"):
        validate_spec({"scheme": "domain", "bug_compat_office_labels": True})


# ---- the official code's data bugs (§8.1, §8.2) -------------------------------------------------
def test_office_labels_correct_path_keeps_pairs_and_flag_breaks_them_as_the_code(tmp_path):
    """Correct: a client's sample i is image idx[i] with label y[idx[i]]. Flagged: the image is the i-th image of
    the client's domain (OfficeDataset_sub never subsets `paths`), the label still y[idx[i]]."""
    tr, te, trd, ted = _office_like()
    spec = {"scheme": "domain", "clients_per_domain": 3, "alpha": 0.1, "fixed_seed": 0}
    good = make_partition(spec, 0, tr, te, trd, ted)
    bad = make_partition({**spec, "bug_compat_office_labels": True}, 0, tr, te, trd, ted)
    assert good.train_images is None and good.test_images is None
    assert all(np.array_equal(x, y) for x, y in zip(good.train + good.test, bad.train + bad.test))  # same labels
    for c, (idx, img) in enumerate(zip(bad.train, bad.train_images)):
        # the domain's first n images, in the random order the code's shuffled index list pairs them with labels
        np.testing.assert_array_equal(np.sort(img), np.flatnonzero(trd == c // 3)[:len(idx)])
    for idx, img in zip(bad.test, bad.test_images):
        if len(idx):
            np.testing.assert_array_equal(np.sort(img), np.flatnonzero(ted == ted[idx[0]])[:len(idx)])
        else:
            assert len(img) == 0
    # the shown image's true class no longer matches the label for many samples
    shown, labels = np.concatenate(bad.train_images), np.concatenate(bad.train)
    assert np.mean(tr[shown] != tr[labels]) > 0.5
    assert partition_id({**spec, "bug_compat_office_labels": True}) != partition_id(spec)
    bad.save(tmp_path / "p.npz")
    back = Partition.load(tmp_path / "p.npz")
    assert all(np.array_equal(x, y) for x, y in zip(back.train_images + back.test_images,
                                                    bad.train_images + bad.test_images))


def test_office_labels_pair_labels_with_images_at_random_as_the_code_even_in_a_class_ordered_pickle():
    """The code shuffles each client's index list (Dataset_partition_office) before OfficeDataset_sub pairs its
    labels with the domain's first images, so a label meets the image of its own class only by chance. Pairing the
    k-th smallest index with the k-th image would instead follow the pickle's order: in a domain listed class by
    class (as a per-folder listing is), the sorted labels and the first images rise through the classes together."""
    tr, te = np.repeat(np.arange(10), 77), np.repeat(np.arange(10), 19)  # one domain, listed class by class
    spec = {"scheme": "domain", "clients_per_domain": 3, "alpha": 0.1, "fixed_seed": 0,
            "bug_compat_office_labels": True}
    bad = make_partition(spec, 0, tr, te, np.zeros_like(tr), np.zeros_like(te))
    for idx, img in zip(bad.train, bad.train_images):
        agree = np.mean(tr[idx] == tr[img])
        chance = np.sum(np.bincount(tr[idx], minlength=10) * np.bincount(tr[img], minlength=10)) / len(idx) ** 2
        assert abs(agree - chance) < 0.1, (agree, chance)


def test_classname_order_flag_is_a_fixed_permutation_beside_an_unchanged_partition(tmp_path):
    tr, te = _labels([10] * 47, 0), _labels([4] * 47, 1)
    spec = {"scheme": "fewshot_pathological", "clients": 10, "shots": 2, "fixed_seed": 2023}
    good = make_partition(spec, 0, tr, te)
    bad = make_partition({**spec, "bug_compat_classname_order": True}, 1, tr, te)
    assert good.class_order is None
    assert sorted(bad.class_order.tolist()) == list(range(47))
    assert np.mean(bad.class_order != np.arange(47)) > 0.8
    np.testing.assert_array_equal(bad.class_order, classname_order(47, 2023))  # seeded: same in every process
    assert all(np.array_equal(x, y) for x, y in zip(good.train + good.test, bad.train + bad.test))
    bad.save(tmp_path / "p.npz")
    np.testing.assert_array_equal(Partition.load(tmp_path / "p.npz").class_order, bad.class_order)


def test_paired_split_shows_the_partition_images_with_the_partition_labels():
    """What a run trains on: the correct path keeps every (image, label) pair of the dataset; the flagged
    partition pairs the domain's first images with the partition's labels."""
    import torch

    from fedcore.engine.data import DeviceSplit
    from fedcore.train import paired_split

    tr, te, trd, ted = _office_like()
    x = torch.arange(len(tr)).view(-1, 1, 1, 1).expand(-1, 2, 2, 3).to(torch.uint8)  # image i "shows" i % 256
    split = DeviceSplit(x=x, y=torch.as_tensor(tr), extras={"tok": torch.arange(len(tr)).float()})
    spec = {"scheme": "domain", "clients_per_domain": 3, "alpha": 0.1, "fixed_seed": 0}
    good = make_partition(spec, 0, tr, te, trd, ted)
    same, idx = paired_split(split, good.train, good.train_images)
    assert same is split
    for a, i in zip(good.train, idx):
        assert torch.equal(i, torch.as_tensor(a))
    bad = make_partition({**spec, "bug_compat_office_labels": True}, 0, tr, te, trd, ted)
    paired, idx = paired_split(split, bad.train, bad.train_images)
    for a, img, i in zip(bad.train, bad.train_images, idx):
        np.testing.assert_array_equal(paired.y[i].numpy(), tr[a])  # labels follow the partition
        np.testing.assert_array_equal(paired.extras["tok"][i].numpy(), img)  # per-image data follows the image
        np.testing.assert_array_equal(paired.x[i][:, 0, 0, 0].numpy(), (img % 256).astype(np.uint8))


def test_prompt_class_names_label_order_or_the_flagged_permutation():
    from fedcore.partition.class_order import prompt_class_names

    names = ["back_pack", "bike", "calculator", "headphones"]
    assert prompt_class_names(names, None) == names
    assert prompt_class_names(names, np.array([2, 0, 3, 1])) == ["calculator", "back_pack", "headphones", "bike"]
    with pytest.raises(ValueError, match="3 entries for 4 class names"):
        prompt_class_names(names, np.array([0, 1, 2]))
