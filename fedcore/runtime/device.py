"""The torch device a job runs on."""
from __future__ import annotations

import torch


def pick_device(requested: str = "auto") -> torch.device:
    """CUDA when present (or asked for), CPU otherwise; asking for CUDA without one is an error."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was requested but torch.cuda.is_available() is False")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")
