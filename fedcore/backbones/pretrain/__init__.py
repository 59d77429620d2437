"""Pretraining a mini backbone on a dataset's held-out ``pretrain`` split, by config/backbones.yaml's
``pretrain.objective``: supervised (labels, supervised.py), moco (self-supervised MoCo v3, moco.py) or clip
(image-text contrastive, a CLIP arch: clip.py); what they share is in common.py.

An objective's module is imported only when that objective runs (or its settings are checked), so a pretraining job
imports the code of its own objective alone (its rule's code inputs follow, fedcore/code_inputs.py).
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

from fedcore.data.arrays import DatasetBundle

# objective -> its pretraining function, in the module of this package named like the objective
OBJECTIVES: dict[str, str] = {"supervised": "pretrain_backbone", "moco": "pretrain_moco", "clip": "pretrain_clip"}
# pretrain settings that are not config keys: the pipeline passes them (rule pretrain_backbone)
_NOT_CONFIG = {"bundle", "arch", "tag", "seed", "out_path", "threads", "progress", "device"}


def objective_module(objective: str) -> str:
    """The module that pretrains by ``objective`` (a code input of the jobs that use it)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"pretrain objective must be one of {tuple(OBJECTIVES)}, got {objective!r}")
    return f"{__name__}.{objective}"


def _pretrainer(objective: str) -> Callable[..., dict]:
    """The pretraining function of `objective`."""
    return getattr(importlib.import_module(objective_module(objective)), OBJECTIVES[objective])


def objective_keys(objective: str) -> list[str]:
    """The config keys (config/backbones.yaml ``pretrain:``) that `objective`'s pretraining accepts."""
    return sorted(set(inspect.signature(_pretrainer(objective)).parameters) - _NOT_CONFIG)


def pretrain(bundle: DatasetBundle, arch: str, tag: str | None = None, objective: str = "supervised",
             **kwargs) -> dict:
    """Pretrain `arch` on bundle.pretrain by `objective`: supervised (labels, ``supervised.pretrain_backbone``), moco
    (self-supervised MoCo v3, ``moco.pretrain_moco``) or clip (image-text contrastive, a CLIP arch:
    ``clip.pretrain_clip``); the other keywords go to that function."""
    return _pretrainer(objective)(bundle, arch, tag, **kwargs)
