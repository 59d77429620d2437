"""Paper-scale converters: verified raw files (archives already extracted) -> DatasetBundle.

Each converter takes the list of inputs the registry prepared for one dataset (plain files, and
directories where an archive was extracted) and finds what it needs inside them by name, so it
does not depend on where the resources directory lives. No paper-scale bundle has a pretrain split
(the papers start from public pretrained backbones).

Layouts read:

* CIFAR-10 / CIFAR-100: the official python-pickle batches (``cifar-10-batches-py/``,
  ``cifar-100-python/``); CIFAR-100 keeps its 20 coarse labels and coarse class names.
* SVHN: ``train_32x32.mat`` / ``test_32x32.mat`` (label 10 means digit 0).
* MNIST / Fashion-MNIST: the four idx ``.gz`` files; grey is replicated to RGB.
* Tiny-ImageNet: the official ``tiny-imagenet-200.zip``; ``train/`` is train, ``val/`` with
  ``val_annotations.txt`` is test (the official test split has no labels). Classes = sorted wnids.
* notMNIST: ``notMNIST_small`` (folders ``A``..``J`` of 28x28 PNGs), split 90/10 with a fixed seed,
  stratified by class; unreadable PNGs (the archive is known to hold a few) are skipped and counted.
* Office-Caltech10 / DomainNet: FedBN's preprocessed archives. Layout A (FedBN, what the SGPT
  and FedOTP code read): ``<site>_train.pkl`` / ``<site>_test.pkl`` per domain, each a pickled pair
  (image paths, labels), beside the image folders; paths are resolved against the pickle's folder
  and its parents, dropping leading components until the file is found (FedBN stores them
  relative to its own data root). We could not inspect the archives here, so layout B is also
  supported: ``<root>/<domain>/<class>/*.jpg|jpeg|png`` with a fixed-seed 80/20 per-class split
  per domain. Images are resized to FEATURE_SHIFT_SIZE. Within each domain the pickle order is
  kept, because the SGPT code takes "the first int(f*min_len) images" of each train pickle.
* Five-dataset: a composite of SVHN, CIFAR-10, notMNIST, Fashion-MNIST, MNIST at 32x32 RGB;
  domain = source index, labels offset by 10*domain (sgpt.md §7 item 13).
"""
from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from PIL import Image, UnidentifiedImageError

from fedcore.data.arrays import ArrayDataset, DatasetBundle

FEATURE_SHIFT_SIZE = 224   # Office/DomainNet: the ViT's input size, so images are resampled only once
FIVE_SIZE = 32             # Five-dataset: common size of its five sources
NOTMNIST_SPLIT_SEED = 0    # fixed: the split must not depend on the run seed
NOTMNIST_TEST_FRACTION = 0.10
FALLBACK_SPLIT_SEED = 0    # Office/DomainNet layout B only
FALLBACK_TEST_FRACTION = 0.20
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")

OFFICE_DOMAINS = ["amazon", "caltech", "dslr", "webcam"]
OFFICE_CLASSES = ["back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer",
                  "monitor", "mouse", "mug", "projector"]
DOMAINNET_DOMAINS = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
DOMAINNET_CLASSES = ["bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale",
                     "windmill", "wine_glass", "zebra"]
FIVE_ORDER = ["svhn", "cifar10", "notmnist", "fashion_mnist", "mnist"]
DIGITS = [str(i) for i in range(10)]


# ---- helpers -------------------------------------------------------------------------------------
def _find_all(inputs: Iterable[Path], name: str) -> list[Path]:
    """Every file or dir called `name` among `inputs` (searched recursively)."""
    hits: list[Path] = []
    for p in inputs:
        p = Path(p)
        if p.name == name:
            hits.append(p)
        elif p.is_dir():
            hits.extend(sorted(p.rglob(name)))
    return hits


def _find(inputs: Iterable[Path], name: str, what: str) -> Path:
    """The single file or dir called `name` among `inputs` (searched recursively)."""
    inputs = list(inputs)
    hits = _find_all(inputs, name)
    if len(hits) != 1:
        raise FileNotFoundError(f"{what}: expected exactly one '{name}' in {[str(p) for p in inputs]}, "
                                f"found {len(hits)}{': ' + ', '.join(map(str, hits[:5])) if hits else ''}")
    return hits[0]


def _unpickle(path: Path) -> dict:
    # The CIFAR batches were pickled under Python 2: keys and strings come back as bytes.
    with open(path, "rb") as fh:
        d = pickle.load(fh, encoding="bytes")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}


def _names(values: Iterable) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def _cifar_images(flat: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(flat, np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))


def _grey_to_rgb(x: np.ndarray) -> np.ndarray:
    return np.repeat(np.asarray(x, np.uint8)[..., None], 3, axis=-1)


def resize_images(x: np.ndarray, size: int) -> np.ndarray:
    """Bilinear-resize uint8 (N,H,W,3) images to (N,size,size,3); a no-op when already that size."""
    if x.shape[1:3] == (size, size):
        return x
    out = np.empty((len(x), size, size, 3), np.uint8)
    for i, im in enumerate(x):
        out[i] = np.asarray(Image.fromarray(im).resize((size, size), Image.BILINEAR))
    return out


def _load_image(path: Path, size: int | None) -> np.ndarray:
    with Image.open(path) as im:
        im = im.convert("RGB")
        if size is not None and im.size != (size, size):
            im = im.resize((size, size), Image.BILINEAR)
        return np.asarray(im, np.uint8)


def _stack(images: list[np.ndarray], size: int) -> np.ndarray:
    return np.stack(images) if images else np.zeros((0, size, size, 3), np.uint8)


# ---- CIFAR ---------------------------------------------------------------------------------------
def cifar10(inputs: list[Path]) -> DatasetBundle:
    """CIFAR-10 from the python batches: 50k train / 10k test, 32x32."""
    base = _find(inputs, "batches.meta", "cifar10").parent
    train = [_unpickle(base / f"data_batch_{i}") for i in range(1, 6)]
    test = _unpickle(base / "test_batch")
    classes = _names(_unpickle(base / "batches.meta")["label_names"])
    return DatasetBundle(
        train=ArrayDataset(x=np.concatenate([_cifar_images(b["data"]) for b in train]),
                           y=np.concatenate([np.asarray(b["labels"]) for b in train])),
        test=ArrayDataset(x=_cifar_images(test["data"]), y=np.asarray(test["labels"])),
        meta={"classes": classes, "source": "CIFAR-10 python version (cifar-10-python.tar.gz)"},
    )


def cifar100(inputs: list[Path]) -> DatasetBundle:
    """CIFAR-100 from the python pickles, with the 20 coarse superclass labels kept."""
    meta_file = _find(inputs, "meta", "cifar100")
    base = meta_file.parent
    meta = _unpickle(meta_file)
    splits = {}
    for split in ("train", "test"):
        d = _unpickle(base / split)
        splits[split] = ArrayDataset(x=_cifar_images(d["data"]), y=np.asarray(d["fine_labels"]),
                                     coarse=np.asarray(d["coarse_labels"]))
    return DatasetBundle(train=splits["train"], test=splits["test"],
                         meta={"classes": _names(meta["fine_label_names"]),
                               "coarse_classes": _names(meta["coarse_label_names"]),
                               "source": "CIFAR-100 python version (cifar-100-python.tar.gz)"})


# ---- SVHN, MNIST, Fashion-MNIST ------------------------------------------------------------------
def _svhn_split(path: Path) -> ArrayDataset:
    from scipy.io import loadmat  # scipy.io is slow to import; only SVHN needs it

    m = loadmat(str(path))
    y = np.asarray(m["y"], np.int64).ravel()
    y[y == 10] = 0  # SVHN encodes digit 0 as label 10
    return ArrayDataset(x=np.ascontiguousarray(np.asarray(m["X"], np.uint8).transpose(3, 0, 1, 2)), y=y)


def svhn(inputs: list[Path]) -> DatasetBundle:
    """SVHN cropped digits (train_32x32.mat / test_32x32.mat), label 10 mapped to 0."""
    return DatasetBundle(train=_svhn_split(_find(inputs, "train_32x32.mat", "svhn")),
                         test=_svhn_split(_find(inputs, "test_32x32.mat", "svhn")),
                         meta={"classes": DIGITS, "source": "SVHN format 2 (cropped digits), train + test"})


def read_idx(path: Path) -> np.ndarray:
    """Read a gzipped idx file (uint8 data: MNIST-style images or labels)."""
    with gzip.open(path, "rb") as fh:
        raw = fh.read()
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path} is not a uint8 idx file (magic {raw[:4].hex()})")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but holds {data.size} values")
    return data.reshape(shape)


def _idx_dataset(inputs: list[Path], what: str, classes: list[str], source: str) -> DatasetBundle:
    def split(prefix: str) -> ArrayDataset:
        x = read_idx(_find(inputs, f"{prefix}-images-idx3-ubyte.gz", what))
        y = read_idx(_find(inputs, f"{prefix}-labels-idx1-ubyte.gz", what))
        return ArrayDataset(x=_grey_to_rgb(x), y=y)

    return DatasetBundle(train=split("train"), test=split("t10k"), meta={"classes": classes, "source": source})


def mnist(inputs: list[Path]) -> DatasetBundle:
    """MNIST (idx .gz files), 28x28 grey replicated to RGB."""
    return _idx_dataset(inputs, "mnist", DIGITS, "MNIST idx files")


FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                   "Bag", "Ankle boot"]


def fashion_mnist(inputs: list[Path]) -> DatasetBundle:
    """Fashion-MNIST (idx .gz files), 28x28 grey replicated to RGB."""
    return _idx_dataset(inputs, "fashion_mnist", FASHION_CLASSES, "Fashion-MNIST idx files")


# ---- Tiny-ImageNet, notMNIST ---------------------------------------------------------------------
def tiny_imagenet(inputs: list[Path]) -> DatasetBundle:
    """Tiny-ImageNet-200: official train/ as train, labelled val/ as test, 64x64."""
    base = _find(inputs, "wnids.txt", "tiny_imagenet").parent
    wnids = sorted(w.strip() for w in (base / "wnids.txt").read_text().split() if w.strip())
    index = {w: i for i, w in enumerate(wnids)}
    words = {}
    if (base / "words.txt").exists():
        for line in (base / "words.txt").read_text().splitlines():
            w, _, text = line.partition("\t")
            if w in index:
                words[w] = text.strip()
    xs, ys = [], []
    for w in wnids:
        for p in sorted((base / "train" / w / "images").glob("*.JPEG")):
            xs.append(_load_image(p, 64))
            ys.append(index[w])
    train = ArrayDataset(x=_stack(xs, 64), y=np.asarray(ys))
    xs, ys = [], []
    for line in sorted((base / "val" / "val_annotations.txt").read_text().splitlines()):
        if not line.strip():
            continue
        fname, w = line.split("\t")[:2]
        xs.append(_load_image(base / "val" / "images" / fname, 64))
        ys.append(index[w])
    test = ArrayDataset(x=_stack(xs, 64), y=np.asarray(ys))
    return DatasetBundle(train=train, test=test,
                         meta={"classes": wnids, "class_words": [words.get(w, w) for w in wnids],
                               "source": "Tiny-ImageNet-200 (train/ = train, val/ = test)"})


NOTMNIST_CLASSES = list("ABCDEFGHIJ")


def notmnist(inputs: list[Path]) -> DatasetBundle:
    """notMNIST_small (letters A-J, 28x28), fixed-seed stratified 90/10 split, unreadable files skipped."""
    # The class folders' parent, whatever it is called (the archive's top folder is notMNIST_small).
    bases = sorted({a.parent for p in inputs for a in ([Path(p)] + sorted(Path(p).rglob("A")))
                    if a.name == "A" and a.is_dir() and (a.parent / "J").is_dir()})
    if len(bases) != 1:
        raise FileNotFoundError(f"notmnist: expected one folder holding class folders A..J in "
                                f"{[str(p) for p in inputs]}, found {[str(b) for b in bases]}")
    base = bases[0]
    xs, ys, skipped = [], [], []
    for c, letter in enumerate(NOTMNIST_CLASSES):
        folder = base / letter
        if not folder.is_dir():
            raise FileNotFoundError(f"notmnist: class folder {folder} is missing")
        for p in sorted(folder.glob("*.png")):
            try:
                xs.append(_load_image(p, 28))
            except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
                skipped.append(f"{letter}/{p.name}")  # the archive holds a few truncated PNGs
                continue
            ys.append(c)
    x, y = _stack(xs, 28), np.asarray(ys, np.int64)
    from sklearn.model_selection import train_test_split  # here: scikit-learn costs every config load ~2 s of import

    tr, te = train_test_split(np.arange(len(y)), test_size=NOTMNIST_TEST_FRACTION, stratify=y,
                              random_state=NOTMNIST_SPLIT_SEED)
    tr, te = np.sort(tr), np.sort(te)
    return DatasetBundle(train=ArrayDataset(x=x[tr], y=y[tr]), test=ArrayDataset(x=x[te], y=y[te]),
                         meta={"classes": NOTMNIST_CLASSES, "skipped_files": skipped,
                               "source": f"notMNIST_small, stratified {1 - NOTMNIST_TEST_FRACTION:.0%}/"
                                         f"{NOTMNIST_TEST_FRACTION:.0%} split, seed {NOTMNIST_SPLIT_SEED}"})


# ---- Office-Caltech10 / DomainNet (FedBN subsets) ------------------------------------------------
class _PathResolver:
    """Resolve FedBN's stored image paths against candidate roots, remembering what worked."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots, self.hint = roots, None  # hint: (root, number of leading parts dropped)

    def __call__(self, stored: str) -> Path:
        parts = [p for p in str(stored).replace("\\", "/").split("/") if p not in ("", ".", "..")]
        tries = ([self.hint] if self.hint else []) + [(r, k) for k in range(len(parts)) for r in self.roots]
        for root, k in tries:
            cand = root.joinpath(*parts[k:])
            if cand.is_file():
                self.hint = (root, k)
                return cand
        raise FileNotFoundError(f"image '{stored}' listed in a FedBN pickle was not found under "
                                f"{[str(r) for r in self.roots]}")


def _pickle_split(pkl: Path, classes: list[str], resolve: _PathResolver, size: int) -> tuple[list, list]:
    obj = np.load(pkl, allow_pickle=True)  # safe: only reached after the archive's checksum verified
    paths, labels = obj[0], obj[1]
    if len(paths) != len(labels):
        raise ValueError(f"{pkl}: {len(paths)} paths but {len(labels)} labels")
    xs, ys = [], []
    for p, lab in zip(paths, labels):
        if isinstance(lab, (str, bytes, np.str_)):
            name = lab.decode() if isinstance(lab, bytes) else str(lab)
            if name not in classes:
                raise ValueError(f"{pkl}: label '{name}' is not one of {classes}")
            lab = classes.index(name)
        xs.append(_load_image(resolve(p), size))
        ys.append(int(lab))
    return xs, ys


def _folder_split(domain_dir: Path, classes: list[str], size: int) -> tuple[tuple[list, list], tuple[list, list]]:
    unknown = sorted(d.name for d in domain_dir.iterdir() if d.is_dir() and d.name not in classes)
    if unknown:
        raise ValueError(f"{domain_dir}: class folders {unknown} are not among {classes}")
    files, ys = [], []
    for c, name in enumerate(classes):
        found = sorted(p for p in (domain_dir / name).glob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise FileNotFoundError(f"{domain_dir / name}: no images (.jpg/.jpeg/.png)")
        files += found
        ys += [c] * len(found)
    from sklearn.model_selection import train_test_split  # here: scikit-learn costs every config load ~2 s of import

    tr, te = train_test_split(np.arange(len(ys)), test_size=FALLBACK_TEST_FRACTION, stratify=ys,
                              random_state=FALLBACK_SPLIT_SEED)
    pick = lambda idx: ([_load_image(files[i], size) for i in sorted(idx)], [ys[i] for i in sorted(idx)])
    return pick(tr), pick(te)


def _feature_shift(inputs: list[Path], what: str, domains: list[str], classes: list[str], source: str,
                   size: int | None = None) -> DatasetBundle:
    size = size or FEATURE_SHIFT_SIZE  # read at call time so it stays a tunable module constant
    parts: dict[str, list] = {"train": [[], [], []], "test": [[], [], []]}  # x, y, domain
    # Layout B only when there is no pickle at all: several pickles is an ambiguity to report.
    pkl_name = f"{domains[0]}_train.pkl"
    first_pkl = _find(inputs, pkl_name, what) if _find_all(inputs, pkl_name) else None
    if first_pkl is not None:
        layout = "FedBN pickles (<site>_train.pkl / <site>_test.pkl)"
        base = first_pkl.parent
        resolve = _PathResolver([base, *list(base.parents)[:2]])
        for d, dom in enumerate(domains):
            for split in ("train", "test"):
                pkl = base / f"{dom}_{split}.pkl"
                if not pkl.exists():
                    raise FileNotFoundError(f"{what}: {pkl} is missing (found {first_pkl})")
                xs, ys = _pickle_split(pkl, classes, resolve, size)
                parts[split][0] += xs
                parts[split][1] += ys
                parts[split][2] += [d] * len(ys)
    else:
        layout = (f"folders <root>/<domain>/<class>/*, stratified {1 - FALLBACK_TEST_FRACTION:.0%}/"
                  f"{FALLBACK_TEST_FRACTION:.0%} split per domain, seed {FALLBACK_SPLIT_SEED}")
        first_dir = _find(inputs, domains[0], what)
        root = first_dir.parent
        for d, dom in enumerate(domains):
            if not (root / dom).is_dir():
                raise FileNotFoundError(f"{what}: neither {dom}_train.pkl nor folder {root / dom} found")
            for split, (xs, ys) in zip(("train", "test"), _folder_split(root / dom, classes, size)):
                parts[split][0] += xs
                parts[split][1] += ys
                parts[split][2] += [d] * len(ys)
    ds = {s: ArrayDataset(x=_stack(p[0], size), y=np.asarray(p[1], np.int64), domain=np.asarray(p[2], np.int64))
          for s, p in parts.items()}
    return DatasetBundle(train=ds["train"], test=ds["test"],
                         meta={"classes": classes, "domains": domains, "source": f"{source}; layout: {layout}",
                               "image_size": size, "folder_layout": first_pkl is None})


# the datasets _feature_shift builds, which may come from image folders (allow_folder_layout)
FOLDER_LAYOUT_DATASETS = ("office_caltech10", "domainnet")


def office_caltech10(inputs: list[Path]) -> DatasetBundle:
    """Office-Caltech10 (FedBN preprocessed), 4 domains, 10 classes, domain = site index."""
    return _feature_shift(inputs, "office_caltech10", OFFICE_DOMAINS, OFFICE_CLASSES,
                          "Office-Caltech10, FedBN preprocessed (office_caltech_10_dataset.zip)")


def domainnet(inputs: list[Path]) -> DatasetBundle:
    """DomainNet top-10-class subset (FedBN preprocessed), 6 domains, domain = site index."""
    return _feature_shift(inputs, "domainnet", DOMAINNET_DOMAINS, DOMAINNET_CLASSES,
                          "DomainNet 10-class subset, FedBN preprocessed (domainnet_dataset.zip)")


# ---- Five-dataset --------------------------------------------------------------------------------
def five_dataset(components: dict[str, DatasetBundle], size: int = FIVE_SIZE) -> DatasetBundle:
    """Five-dataset composite: 50-way labels y + 10*domain, domain = index in FIVE_ORDER, 32x32 RGB."""
    missing = [n for n in FIVE_ORDER if n not in components]
    if missing:
        raise KeyError(f"five_dataset needs component bundles {missing}")
    splits = {}
    for split in ("train", "test"):
        xs, ys, ds = [], [], []
        for d, name in enumerate(FIVE_ORDER):
            part = getattr(components[name], split)
            xs.append(resize_images(part.x, size))
            ys.append(part.y + 10 * d)
            ds.append(np.full(len(part), d, np.int64))
        splits[split] = ArrayDataset(x=np.concatenate(xs), y=np.concatenate(ys), domain=np.concatenate(ds))
    classes = [f"{name}:{c}" for name in FIVE_ORDER for c in components[name].meta["classes"]]
    if len(classes) != 10 * len(FIVE_ORDER):
        raise ValueError(f"five_dataset: every component must have 10 classes, got {len(classes)} in total")
    return DatasetBundle(train=splits["train"], test=splits["test"],
                         meta={"classes": classes, "domains": list(FIVE_ORDER), "image_size": size,
                               "source": "Five-dataset: " + ", ".join(components[n].meta["source"] for n in FIVE_ORDER)})


CONVERTERS: dict[str, Callable[[list[Path]], DatasetBundle]] = {
    "cifar10": cifar10, "cifar100": cifar100, "svhn": svhn, "mnist": mnist,
    "fashion_mnist": fashion_mnist, "tiny_imagenet": tiny_imagenet, "notmnist": notmnist,
    "office_caltech10": office_caltech10, "domainnet": domainnet,
}
COMPOSITES: dict[str, list[str]] = {"five_dataset": FIVE_ORDER}
