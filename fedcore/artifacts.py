"""Per-sample artifacts a method declares (``Method.artifacts``) and rule ``features`` builds once per dataset.

An artifact key names what is computed, e.g. ``cls_block3``: the frozen, un-prompted backbone's final-norm
CLS token after block 3 (SGPT's Select query). Its file is ``features/<backbone>/<dataset>/<key>.npz``;
training runs load it into the splits' ``extras`` under the name the method chose, so batches carry it.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

#: key pattern -> what it is (for messages); the builder is chosen by the pattern in ``build_artifact``
KINDS = {r"cls_block(\d+)": "final-norm CLS token after block N of the frozen backbone"}


def parse(key: str) -> tuple[str, tuple[int, ...]]:
    """(pattern, integer arguments) of an artifact key, or a ValueError listing the known kinds."""
    for pattern in KINDS:
        m = re.fullmatch(pattern, key)
        if m:
            return pattern, tuple(int(g) for g in m.groups())
    raise ValueError(f"unknown artifact {key!r}; known kinds: {sorted(KINDS)}")


def build_artifact(key: str, dataset_path: str | Path, arch: str, weights: str | Path | None,
                   out_path: str | Path, device: str = "auto", threads: int | None = None) -> None:
    """Compute artifact ``key`` for both splits of a dataset and write it atomically."""
    pattern, args = parse(key)
    if pattern == r"cls_block(\d+)":
        from fedcore.features import compute_select_queries

        compute_select_queries(dataset_path, arch, weights, args[0], out_path, device=device, threads=threads)


def load_artifact(key: str, path: str | Path, n_train: int, n_test: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test rows of artifact ``key`` on ``device``, checked against the dataset's sizes."""
    pattern, args = parse(key)
    from fedcore.features import load_select_queries

    return load_select_queries(path, n_train, n_test, args[0], device)
