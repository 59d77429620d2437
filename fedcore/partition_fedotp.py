"""FedOTP's data settings (spec fedotp §3.2; official code facts in official_code.md B4) as partition algorithms.

`fedcore.partition` owns the schemes table, validation, the npz format and the one `make_partition`
entry point; this module holds only the FedOTP-specific draws, all from the rng it is handed:

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
  classname_order       bug_compat_classname_order: a fixed permutation of the class names (the code's names come
                        from a Python set, whose order is hash-randomised per process)
"""
from __future__ import annotations

import numpy as np

from fedcore.partition import _cumulative_cut, _gather

CLASSNAME_STREAM = 0xC1A55  # rng stream of the class-name permutation, apart from the partition's own draw


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


def fewshot_pathological(spec: dict, train_y: np.ndarray, test_y: np.ndarray, rng: np.random.Generator):
    """§3.2a: disjoint class blocks, `shots` random train images per owned class, all test images of them."""
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


def pachinko(spec: dict, train_y: np.ndarray, test_y: np.ndarray, train_coarse: np.ndarray,
             test_coarse: np.ndarray, rng: np.random.Generator):
    """§3.2b: FedEM's Pachinko allocation over the pooled train+test set; returns (train, test) index lists.

    Every draw picks a coarse class by the client's coarse weights, a fine class of it by the client's fine
    weights, then a uniformly random remaining sample of that fine class (without replacement over all
    clients). An exhausted fine class leaves its coarse class's weights (renormalised); an exhausted coarse
    class leaves the coarse weights. Client order is shuffled at the end, as the code does.
    """
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


def coarse_split(spec: dict, train_y: np.ndarray, test_y: np.ndarray, train_coarse: np.ndarray,
                 test_coarse: np.ndarray, rng: np.random.Generator):
    """§3.2e: client c holds coarse class c // (N / C); every fine class of it is split equally (n // share each,
    the remainder unused, as the code's `(50000/100)//5`) over that coarse class's clients, train and test."""
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
    return _gather(train), _gather(test)


def domain_dirichlet(alpha: float, min_size: int, k: int, train_y: np.ndarray, test_y: np.ndarray,
                     train_domain: np.ndarray, test_domain: np.ndarray, rng: np.random.Generator,
                     max_tries: int = 100):
    """§3.2d: k clients per domain; per (domain, class), p ~ Dir(alpha 1_k) cuts the shuffled train and test
    pools alike; a domain is redrawn until each of its clients has >= min_size train samples (the code's seed
    reset inside that loop would redraw the same split forever, official_code.md B4). Client order = domain
    order, then client within the domain."""
    train, test = [], []
    for d in np.unique(train_domain):
        for _ in range(max_tries):
            tr_parts: list[list[np.ndarray]] = [[] for _ in range(k)]
            te_parts: list[list[np.ndarray]] = [[] for _ in range(k)]
            for c in np.unique(train_y[train_domain == d]):
                p = rng.dirichlet(np.full(k, alpha))
                tr_pool = rng.permutation(np.flatnonzero((train_domain == d) & (train_y == c)))
                te_pool = rng.permutation(np.flatnonzero((test_domain == d) & (test_y == c)))
                for parts, pool in ((tr_parts, tr_pool), (te_parts, te_pool)):
                    for i, piece in enumerate(_cumulative_cut(pool, p)):
                        parts[i].append(piece)
            tr, te = _gather(tr_parts), _gather(te_parts)
            if min(len(t) for t in tr) >= min_size:
                break
        else:
            raise ValueError(f"domain partition with alpha={alpha}: after {max_tries} draws a client of domain "
                             f"{int(d)} still has fewer than min_size={min_size} train samples; raise alpha or "
                             f"lower min_size")
        train += [np.sort(t) for t in tr]
        test += [np.sort(t) for t in te]
    return train, test


def office_label_images(indices: list[np.ndarray], domain: np.ndarray) -> list[np.ndarray]:
    """bug_compat_office_labels: the image indices the code pairs with each client's labels.

    OfficeDataset_sub subsets `target` by the partition but not `paths`, so client i's n-th sample is the n-th
    image of its domain (in the domain's file order, which the bundle keeps) with the label of its n-th
    partition index. A client's indices must all lie in one domain.
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
        out.append(np.flatnonzero(domain == doms[0])[: len(idx)].astype(np.int64))
    return out


def classname_order(num_classes: int, seed: int) -> np.ndarray:
    """bug_compat_classname_order: the fixed permutation whose k-th entry is the class whose name prompt k gets.

    The code's names come from a Python set, iterated in a hash-randomised order that changes per process; a
    permutation seeded by the partition seed (its own stream, so the partition's indices are unchanged) makes
    every run of a flagged experiment see the same wrong pairing, reproducibly.
    """
    return np.random.default_rng([int(seed), CLASSNAME_STREAM]).permutation(num_classes).astype(np.int64)


def prompt_class_names(names: list[str], class_order: np.ndarray | None) -> list[str]:
    """The class name that prompt k (the classifier's class k) is written with: ``names[k]``, in label order (the
    correct pairing), or ``names[class_order[k]]`` for a partition made with bug_compat_classname_order."""
    if class_order is None:
        return list(names)
    if len(class_order) != len(names):
        raise ValueError(f"the partition's class_order has {len(class_order)} entries for {len(names)} class names")
    return [names[int(j)] for j in class_order]
