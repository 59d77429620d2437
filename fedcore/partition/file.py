"""The partition file: per-client index arrays into a dataset's splits, with the spec and seed that made them.

One .npz per (dataset, partition id, seed), written by rule ``partition`` (fedcore/partition/make.py) and read by
every run of the experiments that use it, so all methods of an experiment train on the same client data.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.io import atomic_path, read_npz


@dataclass
class Partition:
    """Per-client index arrays into the dataset's splits, plus the spec and seed that made them.

    ``train_images``/``test_images`` (bug_compat_office_labels only) are the indices of the images each client is
    shown in place of ``train``/``test``'s own, whose labels it keeps; ``class_order``
    (bug_compat_classname_order only) is the class whose name prompt k gets (fedcore.partition.class_order).
    """

    train: list[np.ndarray]
    test: list[np.ndarray]
    spec: dict
    seed: int
    train_images: list[np.ndarray] | None = None
    test_images: list[np.ndarray] | None = None
    class_order: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.train = [np.asarray(a, dtype=np.int64) for a in self.train]
        self.test = [np.asarray(a, dtype=np.int64) for a in self.test]
        if len(self.train) != len(self.test):
            raise ValueError(f"{len(self.train)} train lists but {len(self.test)} test lists")
        for name, labels in (("train_images", self.train), ("test_images", self.test)):
            images = getattr(self, name)
            if images is None:
                continue
            images = [np.asarray(a, dtype=np.int64) for a in images]
            if [len(a) for a in images] != [len(a) for a in labels]:
                raise ValueError(f"{name} must give one image per sample of every client")
            setattr(self, name, images)
        if self.class_order is not None:
            self.class_order = np.asarray(self.class_order, dtype=np.int64)
        self.seed = int(self.seed)

    @property
    def num_clients(self) -> int:
        """Number of clients."""
        return len(self.train)

    @property
    def test_from(self) -> str:
        """Which split the test indices index: 'test' (usual) or 'train' (test: split)."""
        return self.spec.get("test_from", "test")

    def save(self, path: str | Path) -> None:
        """Write the partition to one .npz (concatenated indices + offsets + spec json + seed), atomically."""
        arrays = {
            "format": np.array([_FORMAT_VERSION], dtype=np.int64),
            "train_idx": _concat(self.train),
            "train_offsets": _offsets(self.train),
            "test_idx": _concat(self.test),
            "test_offsets": _offsets(self.test),
            "spec_json": np.frombuffer(canonical_json(self.spec).encode(), dtype=np.uint8),
            "seed": np.array([self.seed], dtype=np.int64),
        }
        for name in ("train_images", "test_images"):  # written only when set: other files stay byte-identical
            if getattr(self, name) is not None:
                arrays[f"{name}_idx"] = _concat(getattr(self, name))
        if self.class_order is not None:
            arrays["class_order"] = self.class_order
        with atomic_path(path, suffix=".npz") as tmp:
            with open(tmp, "wb") as fh:  # a file handle stops numpy from appending a second ".npz"
                np.savez(fh, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> "Partition":
        """Read a partition written by save(), with a clear error if missing, unreadable or not a partition."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"partition file {path} does not exist; build it with the pipeline's partition rule")
        z = read_npz(path, "partition")
        missing = sorted(set(_NPZ_KEYS) - set(z))
        if missing:
            raise ValueError(f"{path} is not a fedcore partition file (missing arrays {missing}; has {sorted(z)})")
        spec = json.loads(bytes(z["spec_json"]).decode())
        images = {name: _split_offsets(z[f"{name}_idx"], z[f"{name.split('_')[0]}_offsets"])
                  for name in ("train_images", "test_images") if f"{name}_idx" in z}
        return cls(
            train=_split_offsets(z["train_idx"], z["train_offsets"]),
            test=_split_offsets(z["test_idx"], z["test_offsets"]),
            spec=spec,
            seed=int(z["seed"][0]),
            class_order=z["class_order"] if "class_order" in z else None,
            **images,
        )


_FORMAT_VERSION = 1
_NPZ_KEYS = ("format", "train_idx", "train_offsets", "test_idx", "test_offsets", "spec_json", "seed")


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _offsets(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)


def _split_offsets(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [flat[offsets[i] : offsets[i + 1]].copy() for i in range(len(offsets) - 1)]


def canonical_json(obj: Any) -> str:
    """The one JSON text of ``obj`` (sorted keys, no spaces): a spec's stored form and the input of its id."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
