"""Per-sample artifacts a method declares (``Method.artifacts``) and rule ``features`` builds once per dataset.

An artifact key names what is computed, e.g. ``cls_block3``: the frozen, un-prompted backbone's final-norm
CLS token after block 3 (SGPT's Select query), or ``clip_tokens``: the frozen CLIP's image tokens (FedOTP).
Its file is ``features/<backbone>/<dataset>/<key>.npz``;
training runs load it into the splits' ``extras`` under the name the method chose, so batches carry it.
A new kind is one entry of ``KINDS``: its key pattern, what it is, how to build it and how to load it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


def _build_cls_block(args: tuple[int, ...], dataset_path, arch, weights, out_path, device, threads) -> None:
    """The frozen CLS after block args[0] for both splits (fedcore.features)."""
    from fedcore.features import compute_select_queries

    compute_select_queries(dataset_path, arch, weights, args[0], out_path, device=device, threads=threads)


def _load_cls_block(args: tuple[int, ...], path, n_train: int, n_test: int, device) -> tuple[torch.Tensor, ...]:
    """Train and test rows, checked against the dataset's sizes and the block."""
    from fedcore.features import load_select_queries

    return load_select_queries(path, n_train, n_test, args[0], device)


def _build_clip_tokens(args: tuple[int, ...], dataset_path, arch, weights, out_path, device, threads) -> None:
    """The frozen CLIP CLS + patch tokens of both splits (fedcore.clip_features)."""
    from fedcore.clip_features import compute_clip_tokens

    compute_clip_tokens(dataset_path, arch, weights, out_path, device=device, threads=threads)


def _load_clip_tokens(args: tuple[int, ...], path, n_train: int, n_test: int, device) -> tuple[torch.Tensor, ...]:
    """Train and test tokens, checked against the dataset's sizes and the stored shapes."""
    from fedcore.clip_features import load_clip_tokens

    return load_clip_tokens(path, n_train, n_test, device)


@dataclass(frozen=True)
class Kind:
    """One kind of artifact: what it is, and how it is built and loaded (integer arguments from its key)."""

    description: str
    build: Callable[..., None]
    load: Callable[..., tuple[torch.Tensor, torch.Tensor]]


KINDS: dict[str, Kind] = {
    r"cls_block(\d+)": Kind("final-norm CLS token after block N of the frozen backbone", _build_cls_block,
                            _load_cls_block),
    r"clip_tokens": Kind("the frozen CLIP's CLS and patch tokens after ln_post and @ proj, (1+M, embed_dim), "
                         "float16", _build_clip_tokens, _load_clip_tokens),
}


def parse(key: str) -> tuple[Kind, tuple[int, ...]]:
    """(kind, integer arguments) of an artifact key, or a ValueError listing the known kinds."""
    for pattern, kind in KINDS.items():
        m = re.fullmatch(pattern, key)
        if m:
            return kind, tuple(int(g) for g in m.groups())
    raise ValueError(f"unknown artifact {key!r}; known kinds: "
                     f"{ {p: k.description for p, k in KINDS.items()} }")


def build_artifact(key: str, dataset_path: str | Path, arch: str, weights: str | Path | None,
                   out_path: str | Path, device: str = "auto", threads: int | None = None) -> None:
    """Compute artifact ``key`` for both splits of a dataset and write it atomically."""
    kind, args = parse(key)
    kind.build(args, dataset_path, arch, weights, out_path, device, threads)


def load_artifact(key: str, path: str | Path, n_train: int, n_test: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test rows of artifact ``key`` on ``device``, checked against the dataset's sizes."""
    kind, args = parse(key)
    return kind.load(args, path, n_train, n_test, device)
