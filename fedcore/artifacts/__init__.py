"""Per-sample artifacts a method declares (``Method.artifacts``) and rule ``features`` builds once per dataset.

An artifact key names what is computed, e.g. ``cls_block3``: the frozen, un-prompted backbone's final-norm
CLS token after block 3 (SGPT's Select query, select_queries.py), or ``clip_tokens``: the frozen CLIP's image tokens
(FedOTP, clip_tokens.py). Its file is ``features/<backbone>/<dataset>/<key>.npz``; training runs load it into the
splits' ``extras`` under the name the method chose, so batches carry it.

A new kind is one module of this package with a ``build`` and a ``load`` function, and one entry of ``KINDS``: its
key pattern, the module and what it is. A kind's module is imported only when a key of it is built or loaded, so a
run imports the code of the artifacts it reads and no other (its rule's code inputs follow, fedcore/code_inputs.py).
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch


@dataclass(frozen=True)
class Kind:
    """One kind of artifact: the module of this package that builds and loads it, and what it is."""

    module: str
    description: str


KINDS: dict[str, Kind] = {
    r"cls_block(\d+)": Kind("select_queries", "final-norm CLS token after block N of the frozen backbone"),
    r"clip_tokens": Kind("clip_tokens", "the frozen CLIP's CLS and patch tokens after ln_post and @ proj, "
                                        "(1+M, embed_dim), float16"),
}


def parse(key: str) -> tuple[Kind, tuple[int, ...]]:
    """(kind, integer arguments) of an artifact key, or a ValueError listing the known kinds."""
    for pattern, kind in KINDS.items():
        m = re.fullmatch(pattern, key)
        if m:
            return kind, tuple(int(g) for g in m.groups())
    raise ValueError(f"unknown artifact {key!r}; known kinds: "
                     f"{ {p: k.description for p, k in KINDS.items()} }")


def artifact_module(key: str) -> str:
    """The module that builds and loads artifact ``key`` (imported by name: a code input of the jobs that use it)."""
    return f"{__name__}.{parse(key)[0].module}"


def _kind_code(key: str) -> tuple[ModuleType, tuple[int, ...]]:
    """The imported module of ``key``'s kind and the key's integer arguments."""
    kind, args = parse(key)
    return importlib.import_module(f"{__name__}.{kind.module}"), args


def build_artifact(key: str, dataset_path: str | Path, arch: str, weights: str | Path | None,
                   out_path: str | Path, device: str = "auto", threads: int | None = None,
                   sha256: str | None = None) -> None:
    """Compute artifact ``key`` for both splits of a dataset and write it atomically; the weight file is checked
    against ``sha256`` (registry.check_sha256) before any work."""
    from fedcore.backbones.registry import check_sha256  # the kinds' modules import the backbones anyway

    module, args = _kind_code(key)
    if weights is not None:
        check_sha256(Path(weights), arch, sha256)
    module.build(args, dataset_path, arch, weights, out_path, device, threads)


def load_artifact(key: str, path: str | Path, n_train: int, n_test: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test rows of artifact ``key`` on ``device``, checked against the dataset's sizes."""
    module, args = _kind_code(key)
    return module.load(args, path, n_train, n_test, device)
