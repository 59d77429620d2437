"""A run whose trained state went non-finite (NaN or ±inf): found each round, recorded, never hidden.

A diverged model still scores a number (often chance level, e.g. SCAFFOLD's 9.8 % before its fix, DEVIATIONS.md)
that reads like a result. The papers' code trains such runs on and reports what comes out, so the engine does too,
but each round whose server or client state holds a NaN or an infinity adds a metric row (split ``train``, metric
``diverged``: how many tensors), and the report marks every number of such a run.
"""
from __future__ import annotations

from typing import Any

import torch

from fedcore.metrics import DIVERGED

__all__ = ["DIVERGED", "nonfinite_paths"]


def _floating(payload: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    """The floating-point tensors in a payload (nested dicts, lists, tuples), each with its path (``a.b[2]``)."""
    if isinstance(payload, torch.Tensor):
        return [(path, payload)] if payload.is_floating_point() else []
    if isinstance(payload, dict):
        return [x for k, v in payload.items() for x in _floating(v, f"{path}.{k}")]
    if isinstance(payload, (list, tuple)):
        return [x for i, v in enumerate(payload) for x in _floating(v, f"{path}[{i}]")]
    return []


def nonfinite_paths(payloads: dict[str, Any]) -> list[str]:
    """The paths of the floating tensors in ``payloads`` (by name) that hold a NaN or an infinity."""
    found = [x for name, payload in payloads.items() for x in _floating(payload, name)]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(found):
        by_device.setdefault(t.device, []).append(i)
    bad: set[int] = set()
    for idx in by_device.values():  # one host sync a device (Boundary keeps every state on the run's device)
        finite = torch.stack([torch.isfinite(found[i][1]).all() for i in idx]).tolist()
        bad.update(i for i, ok in zip(idx, finite, strict=True) if not ok)
    return [found[i][0] for i in sorted(bad)]
