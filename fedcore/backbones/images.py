"""uint8 NHWC image batches -> normalised model input, computed on whatever device holds the batch."""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


@lru_cache(maxsize=32)
def _affine(device: torch.device, mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[Tensor, Tensor]:
    """Per-channel scale/shift folding /255 and (x-mean)/std into one multiply-add (cached per device)."""
    m = torch.tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    return 1.0 / (255.0 * s), -m / s


def to_model_input(x_uint8: Tensor, img_size: int, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """(B,H,W,3) uint8 -> (B,3,img_size,img_size) float32, bilinearly resized (if needed) and normalised."""
    if x_uint8.dtype != torch.uint8 or x_uint8.ndim != 4 or x_uint8.shape[-1] != 3:
        raise ValueError(f"expected uint8 (B,H,W,3), got {x_uint8.dtype} {tuple(x_uint8.shape)}")
    scale, shift = _affine(x_uint8.device, tuple(map(float, mean)), tuple(map(float, std)))
    # NCHW view of the NHWC buffer (channels_last strides): no copy before the float conversion
    x = torch.addcmul(shift, x_uint8.permute(0, 3, 1, 2).float(), scale)
    if x.shape[-2:] != (img_size, img_size):
        # the normalisation is affine and bilinear weights sum to 1, so normalising first is exact
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False, antialias=False)
    return x
