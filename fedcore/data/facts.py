"""Static facts of every known dataset (class count, domains, split sizes), for config-time checks.

The config is checked before any job runs, so these numbers must be known without building the data: the
embedded datasets' are those ``build_embedded`` produces (tests/test_data_embedded.py checks them); the paper
datasets' are their official sizes. A size that depends on files we do not ship (notMNIST's readable PNGs,
FedBN's Office-Caltech10 and DomainNet pickles) is None: the checks that need it are skipped, and the
partition rule reports the problem when the data is built.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SplitFacts", "DatasetFacts", "FACTS", "SYNTHETIC", "SyntheticSize", "dataset_facts"]


@dataclass(frozen=True)
class SplitFacts:
    """Sizes of one split (None: not known before the data is built)."""

    size: int | None
    min_class: int | None          # samples of its smallest class
    min_domain: int | None = None  # samples of its smallest domain (datasets with domains)


@dataclass(frozen=True)
class DatasetFacts:
    """A dataset's class count, number of domains (0: no domain labels), split sizes, coarse class count (0: no
    coarse labels), and the shape of its images in the bundle: side in pixels and the source's channels (every
    bundle stores RGB; 1 = grey replicated to RGB)."""

    classes: int
    domains: int
    train: SplitFacts
    test: SplitFacts
    coarse: int = 0
    image_size: int | None = None
    channels: int = 3


_UNKNOWN = SplitFacts(None, None, None)

FACTS: dict[str, DatasetFacts] = {
    # embedded (fedcore/data/embedded.py): 942 train / 315 test digits; styled sets split them by style
    "digits": DatasetFacts(10, 0, SplitFacts(942, 92), SplitFacts(315, 30), coarse=5, image_size=16),
    "digits_styles4": DatasetFacts(10, 4, SplitFacts(942, 92, 235), SplitFacts(315, 30, 78), image_size=16),
    "digits_styles6": DatasetFacts(10, 6, SplitFacts(942, 92, 157), SplitFacts(315, 30, 52), image_size=16),
    "digits_five": DatasetFacts(50, 5, SplitFacts(942, 18, 188), SplitFacts(315, 6, 63), image_size=16),
    # FedMD's public data
    "digits_public": DatasetFacts(10, 0, SplitFacts(540, 52), SplitFacts(315, 30), image_size=16),
    # paper datasets (official splits, fedcore/data/sources.py; image sides as the converters store them)
    "cifar10": DatasetFacts(10, 0, SplitFacts(50000, 5000), SplitFacts(10000, 1000), image_size=32),
    "cifar100": DatasetFacts(100, 0, SplitFacts(50000, 500), SplitFacts(10000, 100), coarse=20, image_size=32),
    "svhn": DatasetFacts(10, 0, SplitFacts(73257, None), SplitFacts(26032, None), image_size=32),
    "mnist": DatasetFacts(10, 0, SplitFacts(60000, 5421), SplitFacts(10000, 892), image_size=28, channels=1),
    "fashion_mnist": DatasetFacts(10, 0, SplitFacts(60000, 6000), SplitFacts(10000, 1000), image_size=28,
                                  channels=1),
    "tiny_imagenet": DatasetFacts(200, 0, SplitFacts(100000, 500), SplitFacts(10000, 50), image_size=64),
    "notmnist": DatasetFacts(10, 0, _UNKNOWN, _UNKNOWN, image_size=28, channels=1),  # unreadable PNGs are skipped
    # FedOTP's CLIP datasets, CoOp's splits (spec fedotp Table A1); DTD has 120 images per class (60 / 36); stored
    # as CLIP's test view sees them (224 px, sources_clip.CLIP_SIZE)
    "caltech101": DatasetFacts(100, 0, SplitFacts(4128, None), SplitFacts(2465, None), image_size=224),
    "flowers102": DatasetFacts(102, 0, SplitFacts(4093, None), SplitFacts(2463, None), image_size=224),
    "oxford_pets": DatasetFacts(37, 0, SplitFacts(2944, None), SplitFacts(3669, None), image_size=224),
    "dtd": DatasetFacts(47, 0, SplitFacts(2820, 60), SplitFacts(1692, 36), image_size=224),
    # FedBN pickles, resized to the ViT's 224 px (sources.FEATURE_SHIFT_SIZE)
    "office_caltech10": DatasetFacts(10, 4, _UNKNOWN, _UNKNOWN, image_size=224),
    "domainnet": DatasetFacts(10, 6, _UNKNOWN, _UNKNOWN, image_size=224),
    "five_dataset": DatasetFacts(50, 5, _UNKNOWN, _UNKNOWN, image_size=32),   # holds notMNIST; 32 px RGB composite
}


# ---- synthetic analogues (scale smoke) ----------------------------------------------------------------------
@dataclass(frozen=True)
class SyntheticSize:
    """How many images a synthetic analogue of dataset ``like`` holds: per class (and per domain, for a dataset
    with domains) in each split. Everything else (classes, domains, coarse labels, image side) is ``like``'s."""

    like: str
    train_per_class: int
    test_per_class: int


# name -> size: each paper dataset's smoke analogue (fedcore/data/synthetic.py draws it, seeded), as small as the
# paper's partitions allow (config/scales/smoke.yaml maps the paper datasets onto them; every smoke partition is
# checked against these facts when the config loads, and tests/test_smoke.py draws every one of them)
SYNTHETIC: dict[str, SyntheticSize] = {
    # FedHPL (5 clients; every client scores the whole test set: test: full), FedPFT (its per-client sizes come from
    # the partition), FedOTP Table A1. FedHPL's baselines' protocol (class_subsets: an 80/20 split, then Dirichlet
    # shares of random class subsets) left a client without train or test images at 20-60 images a class (some of
    # seeds 0-4), none at 100 (tests/test_smoke.py checks every smoke partition)
    "smoke_cifar10": SyntheticSize("cifar10", 100, 2),
    "smoke_svhn": SyntheticSize("svhn", 100, 2),
    # FedHPL (its class_subsets left a client without test images at 16 a class, seed 2), FedOTP's pachinko over 100
    # clients (train and test pooled: each client draws 28, 8 of them test on average) and coarse split (every fine
    # class is shared by 5 clients in each split)
    "smoke_cifar100": SyntheticSize("cifar100", 20, 8),
    # SGPT's CIFAR-100: s = 50 classes per client over 100 clients shares every class among 50 clients; no share is
    # empty only with >= 75 images of every class in each split (fedcore/partition/schemes/label_skew.py, classes_per_client)
    "smoke_cifar100_large": SyntheticSize("cifar100", 75, 75),
    "smoke_tiny_imagenet": SyntheticSize("tiny_imagenet", 2, 1),
    # per class and domain: SGPT's 4 clients per domain (Five-dataset); 5 % of DomainNet's smallest domain >= 1;
    # FedOTP's Office split Dir(0.1) over 3 clients a domain, train and test alike
    "smoke_five_dataset": SyntheticSize("five_dataset", 2, 1),
    "smoke_office_caltech10": SyntheticSize("office_caltech10", 3, 3),
    "smoke_domainnet": SyntheticSize("domainnet", 2, 1),
    # FedOTP's few-shot splits take up to 16 shots of every class
    "smoke_caltech101": SyntheticSize("caltech101", 16, 1),
    "smoke_flowers102": SyntheticSize("flowers102", 16, 1),
    "smoke_oxford_pets": SyntheticSize("oxford_pets", 16, 1),
    "smoke_dtd": SyntheticSize("dtd", 16, 1),
}


# datasets whose every class lives in one domain (Five-dataset's labels are y + 10 * domain); in the others with
# domains every class appears in every domain
DOMAIN_OWNS_CLASSES: frozenset[str] = frozenset({"five_dataset"})


def _synthetic_facts(size: SyntheticSize) -> DatasetFacts:
    """The facts of a synthetic analogue: ``like``'s classes, domains, coarse labels and image shape, and balanced
    splits of ``*_per_class`` images per class (per class and domain where every class is in every domain)."""
    like = FACTS[size.like]

    def split(n: int) -> SplitFacts:
        if not like.domains:
            return SplitFacts(like.classes * n, n)
        if size.like in DOMAIN_OWNS_CLASSES:
            return SplitFacts(like.classes * n, n, like.classes // like.domains * n)
        return SplitFacts(like.classes * like.domains * n, like.domains * n, like.classes * n)

    return DatasetFacts(like.classes, like.domains, split(size.train_per_class), split(size.test_per_class),
                        coarse=like.coarse, image_size=like.image_size, channels=like.channels)


FACTS.update({name: _synthetic_facts(size) for name, size in SYNTHETIC.items()})

def dataset_facts(name: str) -> DatasetFacts:
    """The static facts of dataset ``name``."""
    if name not in FACTS:
        raise KeyError(f"no static facts for dataset {name!r}; add it to fedcore/data/facts.py")
    return FACTS[name]
