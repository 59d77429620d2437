"""Seeding every random number generator a run draws from."""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (model initialisation draws from torch's global RNG)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seeding takes 32 bits only
    torch.manual_seed(seed)
