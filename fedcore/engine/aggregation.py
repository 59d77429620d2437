"""Server-side arithmetic shared by methods: weighted averaging, SGPT's moving average of server tensors (its "momentum",
not FedAvgM's momentum on the averaged update: that is a strategy's own ``aggregate``); and label counting."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch


def normalized_weights(weights: Sequence[float]) -> list[float]:
    """Weights scaled to sum to one; a clear error for an empty or all-zero list."""
    total = float(sum(weights))
    if not weights or total <= 0:
        raise ValueError(f"aggregation weights must be non-empty with a positive sum, got {list(weights)}")
    return [float(w) / total for w in weights]


def weighted_average(states: Sequence[Mapping[str, Any]], weights: Sequence[float],
                     names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Sum_i w_i * state_i[name] over the named subset (all keys of the first state by default), in float64; an
    integer tensor (BatchNorm's num_batches_tracked) is rounded to the nearest integer, not truncated (1/3 * 7 + 2/3 * 7
    is 6.999... in float64)."""
    if not states or len(states) != len(weights):
        raise ValueError(f"weighted_average needs one weight per state, got {len(states)} states and "
                         f"{len(weights)} weights")
    w = normalized_weights(weights)
    names = list(names) if names is not None else list(states[0])
    out: dict[str, torch.Tensor] = {}
    for name in names:
        acc = torch.zeros_like(states[0][name], dtype=torch.float64)
        for wi, s in zip(w, states, strict=True):
            acc += wi * s[name].to(torch.float64)
        dtype = states[0][name].dtype
        out[name] = acc.to(dtype) if dtype.is_floating_point or dtype.is_complex else acc.round().to(dtype)
    return out


def server_momentum(previous: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor],
                    beta: float) -> dict[str, torch.Tensor]:
    """Exponential moving average beta * previous + (1 - beta) * current (SGPT Eq. 7) of two states. Not the server
    momentum of FedAvgM (Hsu et al. 2019: v = beta * v + (global - average), global -= server_lr * v), which keeps
    its buffer in the server state."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"momentum must lie in [0, 1], got {beta}")
    return {n: beta * previous[n] + (1.0 - beta) * current[n] for n in current}


def add_counts(counts: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``counts[c] += (labels == c).sum()`` for every c, in place: ``counts.add_(torch.bincount(labels, minlength=...))``
    without its host-device sync on CUDA (bincount reads the labels' max back first); integer counts, so equal."""
    return counts.index_add_(0, labels, torch.ones_like(labels, dtype=counts.dtype))
