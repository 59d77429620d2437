"""What every benchmark prints and times on: the device (CUDA where there is one) and its name."""
from __future__ import annotations

import torch


def device_name(device: torch.device, threads: int) -> str:
    """The GPU's name, or the CPU with its thread count."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {threads} thread(s)"


def bench_device(threads: int, requested: str | None = None) -> tuple[torch.device, str]:
    """Set torch's CPU threads; the device to time on (``requested``, else CUDA where there is one) and its name."""
    torch.set_num_threads(threads)
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, device_name(device, threads)
