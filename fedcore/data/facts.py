"""Static facts of every known dataset (class count, domains, split sizes), for config-time checks.

The config is checked before any job runs, so these numbers must be known without building the data: the
embedded datasets' are those ``build_embedded`` produces (tests/test_data_embedded.py checks them); the paper
datasets' are their official sizes. A size that depends on files we do not ship (notMNIST's readable PNGs,
FedBN's Office-Caltech10 and DomainNet pickles) is None: the checks that need it are skipped, and the
partition rule reports the problem when the data is built.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SplitFacts", "DatasetFacts", "FACTS", "dataset_facts"]


@dataclass(frozen=True)
class SplitFacts:
    """Sizes of one split (None: not known before the data is built)."""

    size: int | None
    min_class: int | None          # samples of its smallest class
    min_domain: int | None = None  # samples of its smallest domain (datasets with domains)


@dataclass(frozen=True)
class DatasetFacts:
    """A dataset's class count, number of domains (0: no domain labels), split sizes and coarse class count
    (0: no coarse labels)."""

    classes: int
    domains: int
    train: SplitFacts
    test: SplitFacts
    coarse: int = 0


_UNKNOWN = SplitFacts(None, None, None)

FACTS: dict[str, DatasetFacts] = {
    # embedded (fedcore/data/embedded.py): 942 train / 315 test digits; styled sets split them by style
    "digits": DatasetFacts(10, 0, SplitFacts(942, 92), SplitFacts(315, 30), coarse=5),
    "digits_styles4": DatasetFacts(10, 4, SplitFacts(942, 92, 235), SplitFacts(315, 30, 78)),
    "digits_styles6": DatasetFacts(10, 6, SplitFacts(942, 92, 157), SplitFacts(315, 30, 52)),
    "digits_five": DatasetFacts(50, 5, SplitFacts(942, 18, 188), SplitFacts(315, 6, 63)),
    "digits_public": DatasetFacts(10, 0, SplitFacts(540, 52), SplitFacts(315, 30)),  # FedMD's public data
    # paper datasets (official splits, fedcore/data/sources.py)
    "cifar10": DatasetFacts(10, 0, SplitFacts(50000, 5000), SplitFacts(10000, 1000)),
    "cifar100": DatasetFacts(100, 0, SplitFacts(50000, 500), SplitFacts(10000, 100), coarse=20),
    "svhn": DatasetFacts(10, 0, SplitFacts(73257, None), SplitFacts(26032, None)),
    "mnist": DatasetFacts(10, 0, SplitFacts(60000, 5421), SplitFacts(10000, 892)),
    "fashion_mnist": DatasetFacts(10, 0, SplitFacts(60000, 6000), SplitFacts(10000, 1000)),
    "tiny_imagenet": DatasetFacts(200, 0, SplitFacts(100000, 500), SplitFacts(10000, 50)),
    "notmnist": DatasetFacts(10, 0, _UNKNOWN, _UNKNOWN),              # unreadable PNGs are skipped
    # FedOTP's CLIP datasets, CoOp's splits (spec fedotp Table A1); DTD has 120 images per class (60 / 36)
    "caltech101": DatasetFacts(100, 0, SplitFacts(4128, None), SplitFacts(2465, None)),
    "flowers102": DatasetFacts(102, 0, SplitFacts(4093, None), SplitFacts(2463, None)),
    "oxford_pets": DatasetFacts(37, 0, SplitFacts(2944, None), SplitFacts(3669, None)),
    "dtd": DatasetFacts(47, 0, SplitFacts(2820, 60), SplitFacts(1692, 36)),
    "office_caltech10": DatasetFacts(10, 4, _UNKNOWN, _UNKNOWN),      # FedBN pickles
    "domainnet": DatasetFacts(10, 6, _UNKNOWN, _UNKNOWN),             # FedBN pickles
    "five_dataset": DatasetFacts(50, 5, _UNKNOWN, _UNKNOWN),          # holds notMNIST
}


def dataset_facts(name: str) -> DatasetFacts:
    """The static facts of dataset ``name``."""
    if name not in FACTS:
        raise KeyError(f"no static facts for dataset {name!r}; add it to fedcore/data/facts.py")
    return FACTS[name]
