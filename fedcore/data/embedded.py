"""Embedded datasets for the `mini` scale, built from scikit-learn's bundled `load_digits`.

The 1,797 real 8x8 digit images ship with scikit-learn, so no download is needed. They stand in
for the papers' datasets as follows:

* ``digits``          clean images, 10 classes, coarse label y // 2 (CIFAR-100 analogue);
* ``digits_styles4``  4 styles as domains, shared 10 classes (Office-Caltech10 analogue);
* ``digits_styles6``  6 styles as domains, shared 10 classes (DomainNet analogue);
* ``digits_five``     5 styles as domains, 50-way labels y + 10*domain (Five-dataset analogue,
  following sgpt.md §7 item 13);
* ``digits_public``   public data for FedMD (FedHPL spec §8.16: 10 classes of their own, disjoint from the private
  data): the held-out PRETRAIN images, each once, all rendered ``inverted`` (a style the clean private sets never
  show); its test split is the test images in the same style. A method that uses it as extra classes offsets
  the labels itself.

A fixed 30% of the images (stratified, seed independent of any run seed) is held out as the
PRETRAIN split that no federated client ever sees; it is rendered in all six styles so that a tiny
ViT pretrained on it learns style-robust features. The rest is split 75/25 into train/test. In the
styled sets each train/test image is rendered in exactly one style, assigned deterministically,
stratified by class and with near-equal style sizes; ``domain`` is the style index.

``meta["clip_names"]`` names each class for a CLIP text prompt ("zero" .. "nine"; "<style> <word>" where the
style is part of the class), ``meta["pretrain_clip_names"]`` the pretrain split's labels: FedOTP's prompts and
the tiny CLIP's captions (fedcore/backbones/pretrain/clip.py) read them; images and labels do not change.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np
from PIL import Image

from fedcore.data.arrays import ArrayDataset, DatasetBundle

IMAGE_SIZE = 16            # side of the rendered RGB images (the 8x8 originals are upsampled)
PRETRAIN_FRACTION = 0.30   # held out for backbone pretraining, never given to a client
TEST_FRACTION = 0.25       # of the non-pretrain images
# Fixed seeds: the data must be identical for every run seed, so they are constants, not config.
SPLIT_SEED = 1797
ASSIGN_SEED = 2024
NOISE_SEED = 7
NOISE_STD = 48.0           # on the 0..255 scale: clearly visible, digit still legible
TINT_FOREGROUND = (255, 170, 40)   # amber ink ...
TINT_BACKGROUND = (20, 30, 90)     # ... on navy paper
ROTATION_QUARTER_TURNS = 1         # fixed 90 degrees: exact (no interpolation) and clearly a domain shift

SOURCE = "sklearn.datasets.load_digits (UCI optical digits, 1,797 8x8 images, bundled with scikit-learn)"

StyleFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


# ---- styles: pure functions (images (N,H,W,3) uint8, source ids (N,)) -> images -------------------
def clean(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Unchanged: light digit on a dark background."""
    return x.copy()


def inverted(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Photographic negative: dark digit on a light background."""
    return 255 - x


def tinted(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Fixed amber-on-navy colouring: the grey level interpolates between the two colours."""
    g = x[..., :1].astype(np.float32) / 255.0
    fg = np.asarray(TINT_FOREGROUND, np.float32)
    bg = np.asarray(TINT_BACKGROUND, np.float32)
    return np.rint(bg + g * (fg - bg)).astype(np.uint8)


def noisy(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Additive gaussian noise, seeded per source image so a rendering never depends on batch order."""
    out = np.empty_like(x)
    for i, sid in enumerate(ids):
        rng = np.random.default_rng([NOISE_SEED, int(sid)])
        noise = rng.normal(0.0, NOISE_STD, size=x.shape[1:3])[..., None]  # same noise on all channels
        out[i] = np.clip(np.rint(x[i].astype(np.float64) + noise), 0, 255).astype(np.uint8)
    return out


def blurred(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Gaussian blur with sigma = 1 pixel per 16 pixels of image side."""
    sigma = x.shape[1] / 16.0
    from scipy.ndimage import gaussian_filter  # here: scipy and scikit-learn cost every config load ~2 s of import

    y = gaussian_filter(x.astype(np.float32), sigma=(0, sigma, sigma, 0), mode="nearest")
    return np.clip(np.rint(y), 0, 255).astype(np.uint8)


def rotated(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Fixed rotation by 90 degrees counter-clockwise."""
    return np.ascontiguousarray(np.rot90(x, k=ROTATION_QUARTER_TURNS, axes=(1, 2)))


STYLES: tuple[str, ...] = ("clean", "inverted", "tinted", "noisy", "blurred", "rotated")
STYLE_FNS: dict[str, StyleFn] = {
    "clean": clean, "inverted": inverted, "tinted": tinted,
    "noisy": noisy, "blurred": blurred, "rotated": rotated,
}

# dataset name -> number of styles used as domains (the first k of STYLES; 0 = clean, no domains)
EMBEDDED_DATASETS: dict[str, int] = {"digits": 0, "digits_styles4": 4, "digits_styles6": 6, "digits_five": 5}
NUM_DIGITS = 10
# how a CLIP prompt names digit d (meta "clip_names"): a word, as CLIP's captions spell numbers, not the glyph
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# public dataset name -> the one style all its images are rendered in (not a domain: no domain labels)
PUBLIC_DATASETS: dict[str, str] = {"digits_public": "inverted"}


# ---- source images and fixed splits --------------------------------------------------------------
@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    # Parsing sklearn's csv costs ~50 ms; cache it, read-only so no caller can alter the cached copy.
    from sklearn.datasets import load_digits  # here: scikit-learn costs every config load ~2 s of import

    d = load_digits()
    images, target = d.images.copy(), d.target.astype(np.int64)
    images.flags.writeable = target.flags.writeable = False
    return images, target


def load_source(size: int = IMAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as clean uint8 (N,size,size,3) grey-as-RGB images, and their labels."""
    images, target = _digits()
    grey = np.rint(images * (255.0 / 16.0)).astype(np.uint8)  # pixel values are 0..16
    if size != grey.shape[1]:
        grey = np.stack([np.asarray(Image.fromarray(g, mode="L").resize((size, size), Image.BILINEAR))
                         for g in grey])
    return np.repeat(grey[..., None], 3, axis=-1), target.copy()


def split_indices() -> dict[str, np.ndarray]:
    """Sorted source indices of the fixed pretrain / train / test splits (disjoint, stratified)."""
    y = _digits()[1]
    idx = np.arange(len(y))
    from sklearn.model_selection import train_test_split  # here: see _digits

    rest, pre = train_test_split(idx, test_size=PRETRAIN_FRACTION, stratify=y, random_state=SPLIT_SEED)
    train, test = train_test_split(rest, test_size=TEST_FRACTION, stratify=y[rest], random_state=SPLIT_SEED + 1)
    return {"pretrain": np.sort(pre), "train": np.sort(train), "test": np.sort(test)}


def assign_styles(ids: np.ndarray, labels: np.ndarray, k: int, salt: int) -> np.ndarray:
    """One style in 0..k-1 per image: shuffled within each class, then dealt round-robin.

    Dealing continues across classes, so every style's size differs by at most one overall and
    by at most one within each class.
    """
    rng = np.random.default_rng([ASSIGN_SEED, k, salt])
    order = np.concatenate([rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)])
    styles = np.empty(len(ids), np.int64)
    styles[order] = np.arange(len(ids)) % k
    return styles


def layout(name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per split, the (source index, style index) of every row of the embedded dataset `name`."""
    if name not in EMBEDDED_DATASETS:
        raise KeyError(f"unknown embedded dataset '{name}'; known: {sorted(EMBEDDED_DATASETS)}")
    k = EMBEDDED_DATASETS[name]
    y = _digits()[1]
    splits = split_indices()
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for salt, split in enumerate(("train", "test")):
        ids = splits[split]
        styles = np.zeros(len(ids), np.int64) if k == 0 else assign_styles(ids, y[ids], k, salt)
        out[split] = (ids, styles)
    pre = splits["pretrain"]
    out["pretrain"] = (np.tile(pre, len(STYLES)), np.repeat(np.arange(len(STYLES)), len(pre)))
    return out


def source_indices(name: str) -> dict[str, np.ndarray]:
    """Per split, the load_digits index each row of `name` was rendered from (for provenance checks)."""
    return {split: ids for split, (ids, _) in layout(name).items()}


def render(x: np.ndarray, ids: np.ndarray, styles: np.ndarray) -> np.ndarray:
    """Render rows of clean images `x` (aligned with source `ids`) each in its style index."""
    out = np.empty_like(x)
    for s in np.unique(styles):
        m = styles == s
        out[m] = STYLE_FNS[STYLES[s]](x[m], ids[m])
    return out


# ---- bundles -------------------------------------------------------------------------------------
def build_public(name: str, size: int = IMAGE_SIZE) -> DatasetBundle:
    """The public dataset `name`: the held-out pretrain images (train) and the test images, in its one style."""
    if name not in PUBLIC_DATASETS:
        raise KeyError(f"unknown public dataset '{name}'; known: {sorted(PUBLIC_DATASETS)}")
    style = PUBLIC_DATASETS[name]
    images, labels = load_source(size)
    splits = split_indices()

    def split(split_name: str) -> ArrayDataset:
        ids = splits[split_name]
        return ArrayDataset(x=STYLE_FNS[style](images[ids], ids), y=labels[ids])

    meta = {"source": SOURCE, "image_size": size, "style": style, "split_seed": SPLIT_SEED,
            "classes": [f"{style}:{c}" for c in range(NUM_DIGITS)],
            "clip_names": [f"{style} {w}" for w in DIGIT_WORDS],
            "note": "train: the held-out pretrain images; test: the test images; both rendered in one style"}
    return DatasetBundle(train=split("pretrain"), test=split("test"), meta=meta)


def build_embedded(name: str, size: int = IMAGE_SIZE) -> DatasetBundle:
    """Build the embedded dataset `name` deterministically (same bytes on every call)."""
    if name in PUBLIC_DATASETS:
        return build_public(name, size)
    rows = layout(name)  # validates name
    k = EMBEDDED_DATASETS[name]
    images, labels = load_source(size)

    def split(split_name: str, fifty_way: bool, with_domain: bool, with_coarse: bool) -> ArrayDataset:
        ids, styles = rows[split_name]
        y = labels[ids] + (NUM_DIGITS * styles if fifty_way else 0)
        return ArrayDataset(x=render(images[ids], ids, styles), y=y,
                            domain=styles if with_domain else None,
                            coarse=labels[ids] // 2 if with_coarse else None)

    digits = [str(c) for c in range(NUM_DIGITS)]
    meta: dict = {
        "source": SOURCE, "image_size": size, "styles": list(STYLES),
        "pretrain_classes": digits,
        "pretrain_clip_names": list(DIGIT_WORDS),
        "pretrain_note": "held-out images rendered in every style; domain = index into 'styles'",
        "split_seed": SPLIT_SEED,
    }
    if k == 0:
        meta["classes"] = digits
        meta["coarse_classes"] = [f"{c}-{c + 1}" for c in range(0, NUM_DIGITS, 2)]
    else:
        meta["domains"] = list(STYLES[:k])
        meta["classes"] = ([f"{s}:{c}" for s in STYLES[:k] for c in digits] if name == "digits_five" else digits)
    # CLIP prompt names, one per class (FedOTP's text prompts; a 50-way class is "<style> <digit word>")
    meta["clip_names"] = ([f"{s} {w}" for s in STYLES[:k] for w in DIGIT_WORDS] if name == "digits_five"
                          else list(DIGIT_WORDS))
    fifty = name == "digits_five"
    bundle = DatasetBundle(
        train=split("train", fifty, k > 0, k == 0),
        test=split("test", fifty, k > 0, k == 0),
        pretrain=split("pretrain", False, True, False),
        meta=meta,
    )
    return bundle
