"""Parameter-count probe (SGPT Table 5, FedHPL Tables 5, 6, 8): trainable counts of full models and of methods.

Models are built with random weights on the meta device (no memory, no weight files, nothing trained);
a model whose init cannot run on meta is built on the CPU instead, which gives the same count.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.io import atomic_path
from fedcore.methods import is_method, method_class

log = logging.getLogger(__name__)

OK = "ok"
NOT_IMPLEMENTED = "not implemented"
COLUMNS = ["column", "source", "arch", "method", "experiment", "num_classes", "trainable", "total", "uploaded", "status",
           "device"]


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of scalar parameters (only those with requires_grad when `trainable_only`)."""
    return int(sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only))


def uploaded_numbers(method: Any, spec: dict[str, Any]) -> int:
    """Numbers a client of the column's method uploads per round: its shared state (parameters and running
    statistics, not BatchNorm's batch counters), only the model parts ``upload_parts`` names when given (FedPFT
    Table 10: φ, τ, h_κ, h_ρ)."""
    keys = method.client.shared_keys(method.keys(0))
    parts = spec.get("upload_parts")
    state = method.initial_state(0, keys)
    return int(sum(v.numel() for k, v in state.items()
                   if not k.endswith("num_batches_tracked") and (parts is None or k.split(".")[0] in parts)))


def _build_method(spec: dict[str, Any]):
    """The method of a ``source: method`` column, built around ``arch``'s prompt adapter."""
    cls = method_class(spec.get("base", spec["method"]))
    backbone = build_backbone(spec["arch"], input_size=spec.get("input_size"))  # the experiment's, if it sets one
    return cls(prompt_adapter(backbone), int(spec["num_classes"]), dict(spec.get("params") or {}))


def _counted(spec: dict[str, Any]) -> tuple[nn.Module, float]:
    """The column's model and, for a method, the numbers its client uploads (built once: a method is the slow part)."""
    if spec["source"] == "method":
        method = _build_method(spec)
        return method.model, uploaded_numbers(method, spec)
    return build_model(spec), math.nan


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The model a Table 5 column counts, on torch's current default device.

    source torchvision|timm: the whole classifier with `num_classes` outputs (FedAvg trains all of it);
    source method: the method's trainable model around the frozen prompt adapter of `arch` (ViT or ResNet),
    built with `params` (and the experiment's `input_size`, if any: FedHPL's pad prompt depends on it).
    """
    source, arch, classes = spec["source"], spec.get("arch"), int(spec["num_classes"])
    if source == "torchvision":
        import torchvision

        return torchvision.models.get_model(arch, weights=None, num_classes=classes)
    if source == "timm":
        import timm

        return timm.create_model(arch, pretrained=False, num_classes=classes)
    if source == "method":
        return _build_method(spec).model
    raise ValueError(f"unknown model source {source!r}; expected torchvision, timm or method")


def _implemented(spec: dict[str, Any]) -> bool:
    """Whether a method column's method has code (a missing one is reported, not raised)."""
    if spec["source"] != "method":
        return True
    base = spec.get("base", spec["method"])
    return is_method(base)


def model_counts(spec: dict[str, Any]) -> dict[str, Any]:
    """Trainable and total parameter counts of one column's model, and the device it was built on."""
    if not _implemented(spec):
        return {"trainable": math.nan, "total": math.nan, "uploaded": math.nan, "status": NOT_IMPLEMENTED,
                "device": ""}
    try:
        with torch.device("meta"):
            (model, uploaded), device = _counted(spec), "meta"
    except (NotImplementedError, RuntimeError) as e:  # an init op without a meta kernel
        log.info("building %s on the CPU: meta device failed (%s)", spec.get("arch"), e)
        (model, uploaded), device = _counted(spec), "cpu"
    return {"trainable": count_parameters(model), "total": count_parameters(model, trainable_only=False),
            "uploaded": uploaded, "status": OK, "device": device}


def param_counts(models: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per Table 5 column: the model spec and its counts (NaN with a status when it cannot be built)."""
    rows = []
    for j, spec in enumerate(models):
        rows.append({"column": j, "source": spec["source"], "arch": spec.get("arch", ""),
                     "method": spec.get("method", ""), "experiment": spec.get("experiment", ""),
                     "num_classes": int(spec["num_classes"]), **model_counts(spec)})
    return pd.DataFrame(rows, columns=COLUMNS).astype({"trainable": "Int64", "total": "Int64", "uploaded": "Int64"})


def write_param_counts(models: list[dict[str, Any]], out_csv: str | os.PathLike) -> pd.DataFrame:
    """Count every model and write the table as CSV, atomically."""
    table = param_counts(models)
    with atomic_path(Path(out_csv)) as tmp:
        table.to_csv(tmp, index=False)
    return table
