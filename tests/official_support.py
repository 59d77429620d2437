"""What the tests/test_official_*.py checks share: comparing named tensors at fp32 tolerance, reporting the worst."""
from __future__ import annotations

import torch
from torch import Tensor

RTOL, ATOL = 1e-5, 1e-6  # fp32; ATOL covers entries near 0, which carry only rounding


def assert_state_close(ours: dict[str, Tensor], theirs: dict[str, Tensor], what: str,
                       keys: list[str] | None = None, verbose: bool = True) -> tuple[float, float]:
    """Every named tensor equal to fp32 tolerance; returns (and prints) the largest absolute and relative
    difference."""
    keys = list(ours) if keys is None else keys
    worst_abs = worst_rel = 0.0
    for k in keys:
        a, b = ours[k].detach().double(), theirs[k].detach().double()
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{what}, {k}: {m}")
        diff = (a - b).abs()
        worst_abs = max(worst_abs, float(diff.max()))
        worst_rel = max(worst_rel, float((diff / b.abs().clamp_min(1e-3)).max()))
    if verbose:
        print(f"{what}: {len(keys)} tensors, max abs diff {worst_abs:.2e}, max rel diff {worst_rel:.2e}")
    return worst_abs, worst_rel


def random_batches(n: int, seed: int, batch: int, classes: int, size: int,
                   missing: tuple[int, ...] = ()) -> list[tuple[Tensor, Tensor]]:
    """``n`` batches of ``batch`` random images (3 x size x size), labels drawn from the classes not in ``missing``
    (the heterogeneous-ResNet checks' shared setting: both sides train on exactly these)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([c for c in range(classes) if c not in missing])
    return [(torch.randn(batch, 3, size, size, generator=g),
             allowed[torch.randint(len(allowed), (batch,), generator=g)]) for _ in range(n)]
