"""In-memory dataset arrays and their on-disk form (one .npz per dataset).

Every dataset, embedded or downloaded, is converted once into this form so that the engine
never depends on a dataset's original file layout: images are uint8 NHWC RGB, labels int64.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedcore.io import atomic_path, read_npz


@dataclass
class ArrayDataset:
    """One split: images (N,H,W,3) uint8, labels (N,) int64, optional domain and coarse-label ids."""

    x: np.ndarray
    y: np.ndarray
    domain: np.ndarray | None = None
    coarse: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.x.dtype != np.uint8 or self.x.ndim != 4 or self.x.shape[-1] != 3:
            raise ValueError(f"images must be uint8 (N,H,W,3), got {self.x.dtype} {self.x.shape}")
        self.y = np.asarray(self.y, dtype=np.int64)
        if len(self.y) != len(self.x):
            raise ValueError(f"{len(self.x)} images but {len(self.y)} labels")
        for name in ("domain", "coarse"):
            v = getattr(self, name)
            if v is not None:
                v = np.asarray(v, dtype=np.int64)
                if len(v) != len(self.x):
                    raise ValueError(f"{name} has {len(v)} entries for {len(self.x)} images")
                setattr(self, name, v)

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class DatasetBundle:
    """A dataset's splits plus metadata (class names, domain names, source)."""

    train: ArrayDataset
    test: ArrayDataset
    pretrain: ArrayDataset | None = None  # held out: never seen by any federated client
    meta: dict = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        """Number of classes (from meta['classes'])."""
        return len(self.meta["classes"])


_SPLITS = ("train", "test", "pretrain")
_FIELDS = ("x", "y", "domain", "coarse")


def save_bundle(bundle: DatasetBundle, path: str | Path) -> None:
    """Write a bundle to one .npz file, atomically."""
    arrays: dict[str, np.ndarray] = {}
    for split in _SPLITS:
        ds = getattr(bundle, split)
        if ds is None:
            continue
        for f in _FIELDS:
            v = getattr(ds, f)
            if v is not None:
                arrays[f"{split}_{f}"] = v
    arrays["meta_json"] = np.frombuffer(json.dumps(bundle.meta).encode(), dtype=np.uint8)
    with atomic_path(path, suffix=".npz") as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)


def bundle_meta(path: str | Path) -> dict:
    """A bundle's meta alone (the arrays are not read)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return json.loads(bytes(z["meta_json"]).decode())
    except FileNotFoundError:
        raise FileNotFoundError(f"dataset file {path} does not exist; build it with the pipeline's data rules")
    except Exception as err:  # noqa: BLE001 - zip, header and key errors alike mean it is not a readable bundle
        raise ValueError(f"{path} is not a readable fedcore dataset bundle ({err})") from err


def load_bundle(path: str | Path) -> DatasetBundle:
    """Read a bundle written by save_bundle, with a clear error if the file is missing, unreadable or not a bundle."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist; build it with the pipeline's data rules")
    z = read_npz(path, "build_dataset")
    if "meta_json" not in z or "train_x" not in z:
        raise ValueError(f"{path} is not a fedcore dataset bundle (keys: {sorted(z)})")
    meta = json.loads(bytes(z["meta_json"]).decode())
    splits = {}
    for split in _SPLITS:
        if f"{split}_x" not in z:
            splits[split] = None
            continue
        splits[split] = ArrayDataset(**{f: z.get(f"{split}_{f}") for f in _FIELDS})
    return DatasetBundle(train=splits["train"], test=splits["test"], pretrain=splits["pretrain"], meta=meta)
