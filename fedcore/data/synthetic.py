"""Synthetic analogues of the paper datasets for the `smoke` scale: no download, seeded, a few images per class.

Each analogue (``fedcore.data.facts.SYNTHETIC``: name -> the paper dataset it stands for and its images per class)
has that dataset's static facts (``fedcore.data.facts.FACTS``): its class count, domains (every class in every
domain, or each class in one domain for Five-dataset), coarse labels (CIFAR-100: 5 fine classes a coarse one), the
image side its bundle is stored at (32 px CIFAR, 64 px Tiny-ImageNet, 224 px for the FedBN and CLIP datasets) and
grey or colour sources, and, where they are static, its class and domain names (Office-Caltech10, DomainNet,
Five-dataset); other classes are named ``class <k>`` (CLIP prompts read them).

An image is its class's fixed random 4x4 template blown up to the image side, shifted by its domain's tint, plus
seeded noise: classes are told apart by colour blocks, so a run learns a little, but nothing here is data. The
bundle's meta says so (``synthetic: true``), and every table and figure at scale smoke says "smoke: synthetic data,
not results" (fedcore/report/render.py).
"""
from __future__ import annotations

import zlib

import numpy as np

from fedcore.data import sources
from fedcore.data.arrays import ArrayDataset, DatasetBundle
from fedcore.data.facts import DOMAIN_OWNS_CLASSES, FACTS, SYNTHETIC, SyntheticSize

SEED = 0x5A0E          # fixed: the data must be identical for every run seed
TEMPLATE_SIDE = 4      # class templates are 4x4 (every stored side, 16..224 px, is a multiple of 4)
NOISE = 32             # uniform noise in [-NOISE, NOISE] on the 0..255 scale
TINT = 64              # a domain shifts every channel by a fixed offset in [-TINT, TINT]
CHUNK = 256            # images drawn at a time (a 224-px chunk is 38 MB of int16)

__all__ = ["build_synthetic", "synthetic_labels", "is_synthetic", "SYNTHETIC"]


def is_synthetic(name: str) -> bool:
    """True for the smoke scale's synthetic analogues."""
    return name in SYNTHETIC


def _names(like: str) -> tuple[list[str], list[str]]:
    """Class and domain names: the paper dataset's own where they are static, else ``class <k>``/``domain <d>``."""
    facts = FACTS[like]
    static = {"office_caltech10": (sources.OFFICE_CLASSES, sources.OFFICE_DOMAINS),
              "domainnet": (sources.DOMAINNET_CLASSES, sources.DOMAINNET_DOMAINS),
              "five_dataset": ([f"{n}:{c}" for n in sources.FIVE_ORDER for c in range(10)], sources.FIVE_ORDER)}
    if like in static:
        classes, domains = static[like]
        return list(classes), list(domains)
    return [f"class {k}" for k in range(facts.classes)], [f"domain {d}" for d in range(facts.domains)]


def _labels(like: str, per_class: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """Labels (and domains) of one split, ``per_class`` images per class (per class and domain), shuffled."""
    facts = FACTS[like]
    y = np.repeat(np.arange(facts.classes), per_class)
    if not facts.domains:
        d = None
    elif like in DOMAIN_OWNS_CLASSES:
        d = y // (facts.classes // facts.domains)
    else:
        y = np.tile(y, facts.domains)
        d = np.repeat(np.arange(facts.domains), facts.classes * per_class)
    order = rng.permutation(len(y))
    return y[order].astype(np.int64), None if d is None else d[order].astype(np.int64)


def _images(y: np.ndarray, d: np.ndarray | None, templates: np.ndarray, tints: np.ndarray, side: int,
            rng: np.random.Generator) -> np.ndarray:
    """uint8 (N, side, side, 3): the class template, blown up, plus the domain's tint and noise."""
    scale = side // TEMPLATE_SIDE
    out = np.empty((len(y), side, side, 3), np.uint8)
    for start in range(0, len(y), CHUNK):
        ys = y[start:start + CHUNK]
        base = templates[ys].repeat(scale, axis=1).repeat(scale, axis=2).astype(np.int16)
        if d is not None:
            base += tints[d[start:start + CHUNK]]
        noise = rng.integers(-NOISE, NOISE + 1, size=base.shape, dtype=np.int16)
        img = np.clip(base + noise, 0, 255).astype(np.uint8)
        out[start:start + len(ys)] = img  # a grey image (one channel) is replicated to RGB
    return out


def _size(name: str, size: SyntheticSize | None) -> SyntheticSize:
    """The registered size of analogue ``name`` unless ``size`` is given."""
    if size is not None:
        return size
    if name not in SYNTHETIC:
        raise KeyError(f"unknown synthetic dataset {name!r}; known: {sorted(SYNTHETIC)}")
    return SYNTHETIC[name]


def _rng(like: str, stream: int) -> np.random.Generator:
    """One of the fixed random streams of ``like``'s analogues (0: labels, 1: templates and noise), so that the
    labels never depend on the images."""
    return np.random.default_rng([SEED, zlib.crc32(like.encode()), stream])


def synthetic_labels(name: str, size: SyntheticSize | None = None) -> dict[str, dict[str, np.ndarray | None]]:
    """Per split, the labels, domains and coarse labels of analogue ``name`` (exactly ``build_synthetic``'s),
    without drawing any image: what a partition needs."""
    size = _size(name, size)
    like = FACTS[size.like]
    rng = _rng(size.like, 0)
    out = {}
    for split, n in (("train", size.train_per_class), ("test", size.test_per_class)):
        y, d = _labels(size.like, n, rng)
        out[split] = {"y": y, "domain": d, "coarse": y // (like.classes // like.coarse) if like.coarse else None}
    return out


def build_synthetic(name: str, size: SyntheticSize | None = None) -> DatasetBundle:
    """The synthetic analogue ``name`` (same bytes on every call); ``size`` replaces its registered images per
    class (tests draw smaller ones of the same shape)."""
    size = _size(name, size)
    like = FACTS[size.like]
    side = like.image_size
    if side is None or side % TEMPLATE_SIDE:
        raise ValueError(f"synthetic analogue of {size.like}: image side {side} is not a multiple of {TEMPLATE_SIDE}")
    rng = _rng(size.like, 1)
    channels = 1 if like.channels == 1 else 3
    templates = rng.integers(0, 256, size=(like.classes, TEMPLATE_SIDE, TEMPLATE_SIDE, channels), dtype=np.int16)
    tints = rng.integers(-TINT, TINT + 1, size=(max(like.domains, 1), 1, 1, channels), dtype=np.int16)
    splits = {}
    for split, labels in synthetic_labels(name, size).items():
        splits[split] = ArrayDataset(x=_images(labels["y"], labels["domain"], templates, tints, side, rng), **labels)
    classes, domains = _names(size.like)
    meta = {"classes": classes, "image_size": side, "synthetic": True, "like": size.like,
            "per_class": {"train": size.train_per_class, "test": size.test_per_class},
            "source": (f"synthetic analogue of {size.like} (scale smoke): seeded 4x4 class templates blown up to "
                       f"{side} px, domain tints and noise; not data, not results")}
    if like.domains:
        meta["domains"] = domains
    if like.coarse:
        meta["coarse_classes"] = [f"coarse {k}" for k in range(like.coarse)]
    return DatasetBundle(train=splits["train"], test=splits["test"], meta=meta)
