"""What the pretraining objectives share: an isolated torch state per run, the lr schedule, AdamW's decay groups and
the random-shift augmentation."""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.utils.deterministic
from torch import Tensor, nn

WARMUP_FRACTION = 0.05  # linear warm-up share of all steps before the cosine decay


@contextlib.contextmanager
def isolated_torch_state(threads: int | None) -> Iterator[None]:
    """Seed/determinism/thread settings for one run, restoring the caller's global torch state afterwards."""
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        if threads:
            torch.set_num_threads(threads)
        # warn_only: on CUDA a few kernels have no deterministic variant; CPU training is bit-exact anyway
        torch.use_deterministic_algorithms(True, warn_only=True)
        # NaN-filling every torch.empty (a debugging aid of deterministic mode) cost ~3% of a step
        torch.utils.deterministic.fill_uninitialized_memory = False
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill


def random_shift(x: Tensor, max_shift: int, generator: torch.Generator) -> Tensor:
    """Shift each uint8 (B,H,W,C) image by up to ±max_shift pixels, edge pixels repeated; one gather, no padding."""
    b, h, w, _ = x.shape
    dev = x.device
    dy = torch.randint(-max_shift, max_shift + 1, (b, 1), generator=generator).to(dev)
    dx = torch.randint(-max_shift, max_shift + 1, (b, 1), generator=generator).to(dev)
    rows = (torch.arange(h, device=dev) + dy).clamp_(0, h - 1)  # (B,H)
    cols = (torch.arange(w, device=dev) + dx).clamp_(0, w - 1)  # (B,W)
    return x[torch.arange(b, device=dev)[:, None, None], rows[:, :, None], cols[:, None, :]]


def lr_factor(step: int, total: int, schedule: str) -> float:
    """Multiplier of the base lr: linear warm-up then cosine to zero, or constant."""
    if schedule == "constant":
        return 1.0
    warm = max(1, int(WARMUP_FRACTION * total))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay for biases, norms (BatchNorm too), position embeddings and the CLS token, as timm."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name.endswith(("pos_embed", "cls_token")) else decay).append(p)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
