"""Paper-scale converters of FedOTP's few-shot CLIP datasets (spec fedotp §3.1): Caltech101, Flowers102,
OxfordPets, DTD, each from its official archive (the files torchvision downloads), with CoOp's train/test split.

The split (Table A1's sizes are CoOp's): CoOp's own ``split_zhou_<Name>.json`` when it is among the inputs (add it
to config/checksums.yaml as a manual file with its digest pinned), else a seeded split made the way CoOp made its
files, per class: shuffle, round(0.5 n) train, round(0.2 n) val (dropped), the rest test (``read_and_split_data``;
OxfordPets: the official test list, and round(0.2 n) of each class of trainval held out as val). The seeded split
has CoOp's sizes (Table A1, tested) but not its images. Class names are CoOp's: Caltech101 drops
``BACKGROUND_Google`` and ``Faces_easy`` and renames airplanes/Faces/Leopards/Motorbikes; Flowers102 those of
CoOp's cat_to_name.json (torchvision's list with its two differences undone, FLOWERS_COOP_NAMES); OxfordPets the breed
in the file name.

Images are stored as CLIP's test transform sees them: shorter side resized to 224 (bicubic), centre crop 224, with
torchvision's Resize + CenterCrop geometry (the official code's; tests/test_official_data.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from fedcore.data.arrays import ArrayDataset, DatasetBundle
from fedcore.data.download import extract
from fedcore.data.sources import IMAGE_SUFFIXES, _find, _find_all

CLIP_SIZE = 224
SPLIT_SEED = 1  # the seeded split's fixed seed (CoOp's own files came from its runs' seed 1 as well)
P_TRAIN, P_VAL = 0.5, 0.2  # CoOp's read_and_split_data / split_trainval proportions

CALTECH_IGNORED = ("BACKGROUND_Google", "Faces_easy")
CALTECH_RENAMES = {"airplanes": "airplane", "Faces": "face", "Leopards": "leopard", "Motorbikes": "motorbike"}
# torchvision's Flowers102.classes (0.29.1) is cat_to_name.json except two names: label 60 "pink-yellow dahlia?" and
# label 78 "lotus"; CoOp (and FedOTP's oxford_flowers.py) read cat_to_name.json: "pink-yellow dahlia", "lotus lotus"
FLOWERS_COOP_NAMES = {"pink-yellow dahlia?": "pink-yellow dahlia", "lotus": "lotus lotus"}
SPLIT_FILES = {"caltech101": "split_zhou_Caltech101.json", "flowers102": "split_zhou_OxfordFlowers.json",
               "oxford_pets": "split_zhou_OxfordPets.json", "dtd": "split_zhou_DescribableTextures.json"}


def load_clip_image(path: Path, size: int = CLIP_SIZE) -> np.ndarray:
    """RGB uint8 (size, size, 3): shorter side resized to `size` (bicubic), then a centre crop (CLIP's test view),
    with torchvision's Resize(size) + CenterCrop(size) geometry to the pixel (the official code's transform)."""
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        long = int(size * max(w, h) / min(w, h))  # torchvision truncates the long side
        im = im.resize((size, long) if w <= h else (long, size), Image.BICUBIC)
        w, h = im.size
        left, top = int(round((w - size) / 2.0)), int(round((h - size) / 2.0))  # and rounds the offset half-even
        return np.asarray(im.crop((left, top, left + size, top + size)), np.uint8)


def coop_class_split(items: dict[int, list], rng: np.random.Generator) -> tuple[list, list]:
    """CoOp's per-class split (Python's round): (train, test) lists of (item, label); val is dropped."""
    train, test = [], []
    for label in sorted(items):
        members = [items[label][i] for i in rng.permutation(len(items[label]))]
        n_train, n_val = round(len(members) * P_TRAIN), round(len(members) * P_VAL)
        train += [(m, label) for m in members[:n_train]]
        test += [(m, label) for m in members[n_train + n_val:]]
    return train, test


def flowers102_classnames() -> list[str]:
    """The 102 flower names in label order, as CoOp's cat_to_name.json spells them (its prompts use these)."""
    from torchvision.datasets import Flowers102

    names = [FLOWERS_COOP_NAMES.get(n, n) for n in Flowers102.classes]
    if len(names) != 102 or len(set(names)) != 102 or any(n not in names for n in FLOWERS_COOP_NAMES.values()):
        raise ValueError("torchvision's Flowers102.classes changed: check the names against CoOp's cat_to_name.json")
    return names


def _bundle(train: list, test: list, classes: list[str], source: str, split: str, size: int) -> DatasetBundle:
    def arrays(pairs: list) -> ArrayDataset:
        x = np.stack([load_clip_image(p, size) for p, _ in pairs]) if pairs else np.zeros((0, size, size, 3), np.uint8)
        return ArrayDataset(x=x, y=np.asarray([lab for _, lab in pairs], np.int64))

    return DatasetBundle(train=arrays(train), test=arrays(test),
                         meta={"classes": classes, "source": source, "split": split, "image_size": size})


def _image_dir(inputs: list[Path], name: str, what: str) -> Path:
    """The one folder called `name` that holds image files itself (an archive may extract into a folder of the
    same name, e.g. images.tar.gz -> images/images/)."""
    found = set()
    for p in inputs:
        p = Path(p)
        for d in ([p] if p.is_dir() else []) + (sorted(p.rglob(name)) if p.is_dir() else []):
            if d.name == name and d.is_dir() and any(f.suffix.lower() in IMAGE_SUFFIXES for f in d.iterdir()):
                found.add(d)
    if len(found) != 1:
        raise FileNotFoundError(f"{what}: expected one folder '{name}' holding images in "
                                f"{[str(p) for p in inputs]}, found {sorted(map(str, found))}")
    return found.pop()


def _split_json(inputs: list[Path], name: str) -> Path | None:
    hits = _find_all(inputs, SPLIT_FILES[name])
    return hits[0] if hits else None


def _from_split_json(path: Path, image_dir: Path) -> tuple[list, list, list[str]]:
    """CoOp's split file: {"train"|"val"|"test": [[relative image path, label, class name], ...]}."""
    data = json.loads(path.read_text())
    names: dict[int, str] = {}
    out = {}
    for split in ("train", "test"):
        pairs = []
        for rel, label, cname in data[split]:
            names[int(label)] = str(cname)
            pairs.append((image_dir / rel, int(label)))
        out[split] = pairs
    if sorted(names) != list(range(len(names))):
        raise ValueError(f"{path}: labels are not 0..{len(names) - 1}")
    return out["train"], out["test"], [names[i] for i in range(len(names))]


def _folders(root: Path, ignored: tuple[str, ...] = ()) -> tuple[dict[int, list], list[str]]:
    """Images per class folder, classes in sorted folder order (CoOp's labels)."""
    folders = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name not in ignored)
    items = {i: sorted(p for p in (root / f).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
             for i, f in enumerate(folders)}
    empty = [folders[i] for i, v in items.items() if not v]
    if empty:
        raise FileNotFoundError(f"{root}: class folders without images: {empty}")
    return items, folders


def _folder_dataset(inputs: list[Path], name: str, image_dir: Path, ignored: tuple[str, ...],
                    renames: dict[str, str], source: str, size: int | None) -> DatasetBundle:
    size = size or CLIP_SIZE
    split_file = _split_json(inputs, name)
    if split_file is not None:
        train, test, classes = _from_split_json(split_file, image_dir)
        return _bundle(train, test, classes, source, f"CoOp {split_file.name}", size)
    items, folders = _folders(image_dir, ignored)
    train, test = coop_class_split(items, np.random.default_rng(SPLIT_SEED))
    return _bundle(train, test, [renames.get(f, f) for f in folders], source, _seeded_note(), size)


def _seeded_note() -> str:
    return (f"seeded per-class split as CoOp's read_and_split_data (train round({P_TRAIN} n), val round({P_VAL} n) "
            f"dropped, test the rest), seed {SPLIT_SEED}: CoOp's sizes, not its images")


def caltech101(inputs: list[Path], size: int | None = None) -> DatasetBundle:
    """Caltech101 (caltech-101.zip holding 101_ObjectCategories.tar.gz), 100 classes as CoOp."""
    dirs = [p for p in _find_all(inputs, "101_ObjectCategories") if p.is_dir()]
    if not dirs:  # the zip holds a second archive: extract it beside itself once
        inner = _find(inputs, "101_ObjectCategories.tar.gz", "caltech101")
        extract(inner, inner.parent)
        dirs = [p for p in _find_all([inner.parent], "101_ObjectCategories") if p.is_dir()]
    if len(dirs) != 1:
        raise FileNotFoundError(f"caltech101: expected one folder 101_ObjectCategories, found {dirs}")
    return _folder_dataset(inputs, "caltech101", dirs[0], CALTECH_IGNORED, CALTECH_RENAMES,
                           "Caltech101 (caltech-101.zip, 101_ObjectCategories)", size)


def dtd(inputs: list[Path], size: int | None = None) -> DatasetBundle:
    """DTD (dtd-r1.0.1.tar.gz, dtd/images/<class>/), 47 textures."""
    images = _find(inputs, "images", "dtd")
    return _folder_dataset(inputs, "dtd", images, (), {}, "Describable Textures (dtd-r1.0.1.tar.gz)", size)


def flowers102(inputs: list[Path], size: int | None = None) -> DatasetBundle:
    """Oxford Flowers102 (102flowers.tgz + imagelabels.mat), 102 classes named as CoOp's cat_to_name.json."""
    from scipy.io import loadmat

    size = size or CLIP_SIZE
    labels = np.asarray(loadmat(str(_find(inputs, "imagelabels.mat", "flowers102")))["labels"]).ravel()
    image_dir = _image_dir(inputs, "jpg", "flowers102")
    split_file = _split_json(inputs, "flowers102")
    if split_file is not None:
        train, test, classes = _from_split_json(split_file, image_dir)
        return _bundle(train, test, classes, "Oxford Flowers102", f"CoOp {split_file.name}", size)
    items: dict[int, list] = {}
    for i, lab in enumerate(labels):
        items.setdefault(int(lab) - 1, []).append(image_dir / f"image_{i + 1:05d}.jpg")
    train, test = coop_class_split(items, np.random.default_rng(SPLIT_SEED))
    return _bundle(train, test, flowers102_classnames(), "Oxford Flowers102 (102flowers.tgz, imagelabels.mat)",
                   _seeded_note(), size)


def oxford_pets(inputs: list[Path], size: int | None = None) -> DatasetBundle:
    """Oxford-IIIT Pets (images.tar.gz + annotations.tar.gz), 37 breeds; test = the official test list."""
    size = size or CLIP_SIZE
    image_dir = _image_dir(inputs, "images", "oxford_pets")
    split_file = _split_json(inputs, "oxford_pets")
    if split_file is not None:
        train, test, classes = _from_split_json(split_file, image_dir)
        return _bundle(train, test, classes, "Oxford-IIIT Pets", f"CoOp {split_file.name}", size)
    names: dict[int, str] = {}

    def read(list_name: str) -> dict[int, list]:
        out: dict[int, list] = {}
        for line in _find(inputs, list_name, "oxford_pets").read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            imname, label = line.split()[:2]
            label = int(label) - 1
            names[label] = "_".join(imname.split("_")[:-1]).lower()
            out.setdefault(label, []).append(image_dir / f"{imname}.jpg")
        return out

    trainval, test_items = read("trainval.txt"), read("test.txt")
    # CoOp's split_trainval: per class, the first round(0.2 n) shuffled images are val, the rest train
    rng, train = np.random.default_rng(SPLIT_SEED), []
    for label in sorted(trainval):
        members = [trainval[label][i] for i in rng.permutation(len(trainval[label]))]
        train += [(m, label) for m in members[round(len(members) * P_VAL):]]
    test = [(p, lab) for lab in sorted(test_items) for p in test_items[lab]]
    return _bundle(train, test, [names[i] for i in range(len(names))],
                   "Oxford-IIIT Pets (images.tar.gz, annotations.tar.gz)",
                   f"seeded CoOp split_trainval (val round({P_VAL} n) of each class dropped), seed {SPLIT_SEED}; "
                   "test = annotations/test.txt", size)


CONVERTERS: dict[str, Callable[[list[Path]], DatasetBundle]] = {
    "caltech101": caltech101, "flowers102": flowers102, "oxford_pets": oxford_pets, "dtd": dtd,
}
