"""FedOTP's data settings (spec fedotp §3.2; official code facts in official_code.md B4) as partition algorithms.

fedcore/partition/ owns validation, the npz format and the one `make_partition` entry point; this module holds only
the FedOTP-specific draws, all from the rng it is handed:

  fewshot_pathological  §3.2a: classes shuffled, disjoint blocks of round(K/N) classes, the last client takes
                        the rest; `shots` train images per owned class; test = every test image of the owned classes
  pachinko              §3.2b noniid-labeldir100 (FedEM's Pachinko allocation): train+test pooled, each client
                        draws total//N samples, coarse ~ Dir(alpha 1_C), fine within coarse ~ Dir(fine_alpha 1_F);
                        a pooled index < n_train is a train sample, else a test sample
  coarse_split          §3.2e iid-label100: client c holds coarse class c // (N / C) and an equal disjoint share of
                        every fine class of it, in train and test
  domain_dirichlet      §3.2d (through scheme `domain` with `alpha`): per domain and per class, proportions
                        ~ Dir(alpha 1_k) over the domain's k clients, the same proportions cut train and test

and the official code's data bugs, as opt-in options (DEVIATIONS.md, "FedOTP data"):

  office_label_images   bug_compat_office_labels: each client's images are the first n images of its domain
                        while its labels follow the partition (OfficeDataset_sub pairs paths[i] with target[map[i]])
  classname_order       bug_compat_classname_order (fedcore/partition/class_order.py, which training reads): a
                        fixed permutation of the class names (the code's names come from a Python set, whose order
                        is hash-randomised per process)
"""
from __future__ import annotations

import numpy as np

from fedcore.constraints import Violation
from fedcore.data.facts import DatasetFacts
from fedcore.partition.draw import cumulative_cut, gather
from fedcore.partition.registry import REQUIRED, Labels, register_scheme


def fewshot_blocks(num_classes: int, clients: int) -> list[tuple[int, int]]:
    """[start, stop) of each client's block of the shuffled class list: round(K/N) each, the last one the rest.

    Python's round (half to even), as the code's `class_per_user = round(n_cls / num_users)`.
    """
    per = round(num_classes / clients)
    blocks = [(i * per, (i + 1) * per) for i in range(clients - 1)] + [((clients - 1) * per, num_classes)]
    empty = [i for i, (a, b) in enumerate(blocks) if min(b, num_classes) <= a]
    if per == 0 or empty:
        raise ValueError(f"fewshot_pathological: {clients} clients with round({num_classes}/{clients}) = {per} "
                         f"classes each leave client(s) {empty or list(range(clients))} without a class; "
                         f"use fewer clients")
    return blocks


def _fewshot_limits(spec: dict, facts: DatasetFacts, dataset: str) -> list[Violation]:
    """FedOTP's few-shot split: every client gets a class block, and every class has `shots` train images."""
    try:
        fewshot_blocks(facts.classes, spec["clients"])
    except ValueError as e:
        return [Violation("partition.clients", spec["clients"], f"1..{facts.classes}", str(e))]
    n = facts.train.min_class
    if n is not None and spec["shots"] > n:
        return [Violation("partition.shots", spec["shots"], f"1..{n}",
                          f"the smallest class of dataset {dataset} has {n} train samples")]
    return []


def _coarse_limits(spec: dict, facts: DatasetFacts, dataset: str) -> list[Violation]:
    """FedOTP's CIFAR-100 splits need coarse labels; coarse_split needs a client count that the coarse classes divide."""
    if facts.coarse == 0:
        return [Violation("partition.scheme", spec["scheme"], "a scheme without coarse labels",
                          f"dataset {dataset} has no coarse labels")]
    if spec["scheme"] == "coarse_split" and spec["clients"] % facts.coarse:
        return [Violation("partition.clients", spec["clients"], f"multiples of {facts.coarse}",
                          f"dataset {dataset} has {facts.coarse} coarse classes, each held by clients / "
                          f"{facts.coarse} clients")]
    return []


@register_scheme("fewshot_pathological", keys={"clients": REQUIRED, "shots": REQUIRED, "test": "owned_classes"},
                 # every test image of the client's classes
                 test_modes=("owned_classes",), limits=_fewshot_limits)
def fewshot_pathological(spec: dict, labels: Labels, rng: np.random.Generator):
    """§3.2a: disjoint class blocks, `shots` random train images per owned class, all test images of them."""
    train_y, test_y = labels.train_y, labels.test_y
    classes = np.unique(train_y)
    order = rng.permutation(classes)
    shots = spec["shots"]
    train, test = [], []
    for a, b in fewshot_blocks(len(classes), spec["clients"]):
        owned = np.sort(order[a:b])
        picks = []
        for c in owned:
            pool = np.flatnonzero(train_y == c)
            if shots > len(pool):
                raise ValueError(f"fewshot_pathological: shots={shots} exceeds the {len(pool)} train images of "
                                 f"class {int(c)}")
            picks.append(np.sort(rng.choice(pool, size=shots, replace=False)))
        train.append(np.concatenate(picks).astype(np.int64))
        test.append(np.flatnonzero(np.isin(test_y, owned)).astype(np.int64))
    return train, test


@register_scheme("pachinko", keys={"clients": REQUIRED, "alpha": REQUIRED, "fine_alpha": 10.0, "test": "pooled"},
                 # the test-split samples of the client's own draw from train+test
                 test_modes=("pooled",), needs=("coarse",), limits=_coarse_limits)
def pachinko(spec: dict, labels: Labels, rng: np.random.Generator):
    """§3.2b: FedEM's Pachinko allocation over the pooled train+test set; returns (train, test) index lists.

    Every draw picks a coarse class by the client's coarse weights, a fine class of it by the client's fine
    weights, then a uniformly random remaining sample of that fine class (without replacement over all
    clients). An exhausted fine class leaves its coarse class's weights (renormalised); an exhausted coarse
    class leaves the coarse weights. Client order is shuffled at the end, as the code does.
    """
    train_y, test_y, train_coarse, test_coarse = labels.train_y, labels.test_y, labels.train_coarse, labels.test_coarse
    y = np.concatenate([train_y, test_y])
    coarse = np.concatenate([train_coarse, test_coarse])
    n_train, k = len(train_y), spec["clients"]
    coarse_ids = np.unique(coarse)
    fines = [np.unique(y[coarse == c]) for c in coarse_ids]
    mixed = [f for c, f in zip(coarse_ids, fines) if np.isin(f, y[coarse != c]).any()]
    if mixed:
        raise ValueError(f"pachinko: fine classes {mixed[0].tolist()} appear under several coarse classes")
    left = {int(f): list(rng.permutation(np.flatnonzero(y == f))) for f in np.unique(y)}  # pop() = random sample
    per_client = len(y) // k
    if per_client == 0:
        raise ValueError(f"pachinko: {k} clients for {len(y)} pooled samples leaves each client none")
    clients = []
    for _ in range(k):
        wc = rng.dirichlet(np.full(len(coarse_ids), spec["alpha"]))
        wf = [rng.dirichlet(np.full(len(f), spec["fine_alpha"])) for f in fines]
        for j, f in enumerate(fines):  # classes another client exhausted are gone for this one too
            wf[j] = np.where([len(left[int(x)]) > 0 for x in f], wf[j], 0.0)
            if wf[j].sum() == 0:
                wc[j] = 0.0
        mine = []
        for _ in range(per_client):
            j = _pick(wc, rng)
            i = _pick(wf[j], rng)
            fine = int(fines[j][i])
            mine.append(left[fine].pop())
            if not left[fine]:
                wf[j][i] = 0.0
                if wf[j].sum() == 0:
                    wc[j] = 0.0
        clients.append(np.asarray(mine, dtype=np.int64))
    clients = [clients[i] for i in rng.permutation(k)]
    train = [np.sort(c[c < n_train]) for c in clients]
    test = [np.sort(c[c >= n_train]) - n_train for c in clients]
    return train, test


def _pick(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn with probability proportional to `weights` (inverse CDF of one uniform draw)."""
    cdf = np.cumsum(weights)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


@register_scheme("coarse_split", keys={"clients": REQUIRED, "test": "class_share"},
                 # the client's equal share of its fine classes' test pools
                 test_modes=("class_share",), needs=("coarse",), limits=_coarse_limits)
def coarse_split(spec: dict, labels: Labels, rng: np.random.Generator):
    """§3.2e: client c holds coarse class c // (N / C); every fine class of it is split equally (n // share each,
    the remainder unused, as the code's `(50000/100)//5`) over that coarse class's clients, train and test."""
    train_y, test_y, train_coarse = labels.train_y, labels.test_y, labels.train_coarse
    coarse_ids = np.unique(train_coarse)
    k = spec["clients"]
    if k % len(coarse_ids):
        raise ValueError(f"coarse_split: clients={k} must be a multiple of the {len(coarse_ids)} coarse classes")
    share = k // len(coarse_ids)
    train: list[list[np.ndarray]] = [[] for _ in range(k)]
    test: list[list[np.ndarray]] = [[] for _ in range(k)]
    for j, c in enumerate(coarse_ids):
        owners = range(j * share, (j + 1) * share)
        for f in np.unique(train_y[train_coarse == c]):
            for parts, y in ((train, train_y), (test, test_y)):
                pool = rng.permutation(np.flatnonzero(y == f))
                n = len(pool) // share
                if n == 0:
                    raise ValueError(f"coarse_split: fine class {int(f)} has {len(pool)} samples in a split, "
                                     f"fewer than its {share} clients")
                for i, owner in enumerate(owners):
                    parts[owner].append(pool[i * n:(i + 1) * n])
    return gather(train), gather(test)


def domain_dirichlet(alpha: float, min_size: int, k: int, train_y: np.ndarray, test_y: np.ndarray,
                     train_domain: np.ndarray, test_domain: np.ndarray, rng: np.random.Generator,
                     max_tries: int = 100):
    """§3.2d: k clients per domain; per (domain, class), p ~ Dir(alpha 1_k) cuts the shuffled train and test
    pools alike, with the code's balance mask (``Dataset_partition_office``: a client already holding at least
    its share N_train / k of the domain's train samples gets no more); a domain is redrawn until each of its
    clients has >= min_size train and test samples (the code's seed reset inside that loop would redraw the same
    split forever, official_code.md B4). Client order = domain order, then client within the domain.

    The cuts are ``cumulative_cut``'s, which re-normalises the (already normalised) shares before the cumulative
    sum: where cumsum(p) x pool size lies within float rounding of an integer, a cut can land one sample off
    the code's ``(np.cumsum(p) * n).astype(int)`` (DEVIATIONS.md, FedOTP data; tests/test_official_data.py)."""
    train, test = [], []
    for d in np.unique(train_domain):
        share = np.count_nonzero(train_domain == d) / k
        for _ in range(max_tries):
            tr_parts: list[list[np.ndarray]] = [[] for _ in range(k)]
            te_parts: list[list[np.ndarray]] = [[] for _ in range(k)]
            for c in np.unique(train_y[train_domain == d]):
                p = rng.dirichlet(np.full(k, alpha))
                p = p * (np.array([sum(len(x) for x in parts) for parts in tr_parts]) < share)
                p = p / p.sum()
                tr_pool = rng.permutation(np.flatnonzero((train_domain == d) & (train_y == c)))
                te_pool = rng.permutation(np.flatnonzero((test_domain == d) & (test_y == c)))
                for parts, pool in ((tr_parts, tr_pool), (te_parts, te_pool)):
                    for i, piece in enumerate(cumulative_cut(pool, p)):
                        parts[i].append(piece)
            tr, te = gather(tr_parts), gather(te_parts)
            if min(len(t) for t in tr + te) >= min_size:
                break
        else:
            raise ValueError(f"domain partition with alpha={alpha}: after {max_tries} draws a client of domain "
                             f"{int(d)} still has fewer than min_size={min_size} train or test samples; raise "
                             f"alpha or lower min_size")
        train += [np.sort(t) for t in tr]
        test += [np.sort(t) for t in te]
    return train, test


def office_label_images(indices: list[np.ndarray], domain: np.ndarray,
                        rng: np.random.Generator) -> list[np.ndarray]:
    """bug_compat_office_labels: the image indices the code pairs with each client's labels.

    OfficeDataset_sub subsets `target` by the partition but not `paths`, so client i's n-th sample is the n-th
    image of its domain (in the domain's file order, which the bundle keeps) with the label of its n-th
    partition index. The code's index list is shuffled (`np.random.shuffle(idx_batch_train[j])` in
    Dataset_partition_office), so which of those first n images meets which label is random; our index lists
    are sorted, so the same first n images are returned in a random order (pairing them with the sorted indices
    would match the k-th smallest index with the k-th image, and in a pickle listed class by class many labels
    would then be right by construction). A client's indices must all lie in one domain.
    """
    out = []
    for i, idx in enumerate(indices):
        doms = np.unique(domain[idx])
        if len(doms) > 1:
            raise ValueError(f"bug_compat_office_labels: client {i} holds samples of domains {doms.tolist()}; "
                             f"the code's bug is defined for one domain per client")
        if len(idx) == 0:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        out.append(rng.permutation(np.flatnonzero(domain == doms[0])[: len(idx)]).astype(np.int64))
    return out
