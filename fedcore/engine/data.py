"""One data path for every method: splits live on the device as uint8, batches are made there.

A batch is ``Batch(x, y, index, extras)``: the model input (normalised, resized images, or cached frozen
features), the labels, the rows of the split it came from, and per-sample extras: artifacts a method
declared (e.g. SGPT's cached Select queries, rule ``features``), indexed by the same rows. Training
batches may be augmented on the device by named, seeded augmentations (``AUGMENTATIONS``), drawn from
the client's generator, so a run stays deterministic and a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from fedcore.backbones.images import to_model_input
from fedcore.data.arrays import ArrayDataset


class Batch(NamedTuple):
    """A batch as every method receives it."""

    x: Tensor                   # model input (B, 3, S, S), or cached features (B, D)
    y: Tensor                   # labels (B,)
    index: Tensor               # rows of the split (B,)
    extras: dict[str, Tensor]   # per-sample artifacts, name -> (B, ...)


@dataclass
class DeviceSplit:
    """One split's images (uint8 NHWC) and labels, resident on the run's device.

    ``features`` holds cached frozen-backbone features when the method declares them (head-only methods):
    batches then carry rows of it as ``x``. ``extras`` holds per-sample artifacts (name -> (N, ...)).
    ``coarse`` holds coarse labels if the dataset has them (CIFAR-100's 20 superclasses), for analyses.
    """

    x: Tensor
    y: Tensor
    features: Tensor | None = None
    coarse: Tensor | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def from_arrays(cls, ds: ArrayDataset, device: torch.device) -> "DeviceSplit":
        """Move a split to the device once; every batch after that is an index into it."""
        coarse = None if ds.coarse is None else torch.from_numpy(np.asarray(ds.coarse, dtype=np.int64)).to(device)
        return cls(torch.from_numpy(np.ascontiguousarray(ds.x)).to(device),
                   torch.from_numpy(ds.y).to(device), coarse=coarse)

    def with_features(self, features: Tensor) -> "DeviceSplit":
        """A copy whose batches carry ``features`` rows instead of images."""
        return replace(self, features=features)


# ---- on-device augmentations ----------------------------------------------------------------------
# Each augmentation is two steps: ``draw`` takes its random numbers from the client's CPU generator (they depend
# only on the batch's shape, so every device gets the same draws), one row per image; ``apply`` warps or recolours
# the images on their device. Split so that several clients' draws, each from its own generator, can be
# concatenated and applied in one batched call (FedPFT's clients trained together); ``aug(x, gen)`` does both.
Draws = dict[str, Any]  # CPU tensors with one row per image (nested: a composite's parts)


@dataclass(frozen=True)
class Augmentation:
    """A seeded batch augmentation split into its random draws and their application."""

    draw: Callable[[int, int, int, torch.Generator], Draws]  # (images, height, width, generator) -> draws
    apply: Callable[[Tensor, Draws], Tensor]                  # (NCHW batch, its draws) -> augmented batch

    def __call__(self, x: Tensor, gen: torch.Generator) -> Tensor:
        """Draw for ``x`` from ``gen`` and apply."""
        return self.apply(x, self.draw(len(x), x.shape[-2], x.shape[-1], gen))


def on_device(t: Tensor, like: Tensor) -> Tensor:
    """A CPU draw (shuffle order, augmentation parameters) on ``like``'s device, copied without waiting for the work
    queued there: a blocking copy to a GPU waits for the whole stream every step. Safe from pageable memory: the copy
    reads the source before it returns."""
    return t.to(like.device, non_blocking=True)


def _draw_flip(n: int, h: int, w: int, gen: torch.Generator) -> Draws:
    return {"mask": torch.rand(n, generator=gen) < 0.5}


def _apply_flip(x: Tensor, d: Draws) -> Tensor:
    return torch.where(on_device(d["mask"], x).view(-1, 1, 1, 1), x.flip(-1), x)


#: horizontal flip of each image with probability 1/2 (NCHW float)
flip = Augmentation(_draw_flip, _apply_flip)

CROP_PAD = 0.125  # crop_flip pads by 1/8 of the side (CIFAR's 4 px at 32)


def _draw_crop_flip(n: int, h: int, w: int, gen: torch.Generator) -> Draws:
    pad = max(1, int(round(CROP_PAD * h)))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    return {"dy": dy, "dx": dx, "flip": _draw_flip(n, h, w, gen)}


def _apply_crop_flip(x: Tensor, d: Draws) -> Tensor:
    b, _, h, w = x.shape
    pad = max(1, int(round(CROP_PAD * h)))
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    dy, dx = on_device(d["dy"], x), on_device(d["dx"], x)
    rows = (dy.view(b, 1) + torch.arange(h, device=x.device)).view(b, 1, h, 1).expand(b, x.shape[1], h, w + 2 * pad)
    out = padded.gather(2, rows)
    cols = (dx.view(b, 1) + torch.arange(w, device=x.device)).view(b, 1, 1, w).expand(b, x.shape[1], h, w)
    return _apply_flip(out.gather(3, cols), d["flip"])


#: CIFAR-style augmentation: zero-pad by 1/8 of the side, random crop back, random horizontal flip
crop_flip = Augmentation(_draw_crop_flip, _apply_crop_flip)


# ---- pixel-space augmentations (colour changes, black fill): they see images in [0, 1] --------------
GREY = (0.299, 0.587, 0.114)  # ITU-R 601-2 luma, as torchvision's rgb_to_grayscale


def _uniform(n: int, low: float, high: float, gen: torch.Generator) -> Tensor:
    """``n`` draws of U(low, high) from the CPU generator."""
    return low + (high - low) * torch.rand(n, generator=gen)


def _warp(x: Tensor, theta: Tensor, mode: str) -> Tensor:
    """Resample every image through its affine map (output -> input, normalised coordinates); zeros outside."""
    grid = torch.nn.functional.affine_grid(on_device(theta, x).to(x.dtype), list(x.shape), align_corners=False)
    return torch.nn.functional.grid_sample(x, grid, mode=mode, padding_mode="zeros", align_corners=False)


def _draw_resized_crop(n: int, h: int, w: int, gen: torch.Generator, scale: tuple[float, float] = (0.2, 1.0),
                       ratio: tuple[float, float] = (3 / 4, 4 / 3), tries: int = 10) -> Draws:
    area = (scale[0] + (scale[1] - scale[0]) * torch.rand(n, tries, generator=gen)) * (h * w)
    log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * torch.rand(n, tries, generator=gen)
    cw, ch = (area * log_r.exp()).sqrt().round(), (area / log_r.exp()).sqrt().round()
    fits = (cw >= 1) & (cw <= w) & (ch >= 1) & (ch <= h)
    first = fits.to(torch.int64).argmax(dim=1, keepdim=True)
    cw = torch.where(fits.any(1), cw.gather(1, first).squeeze(1), torch.tensor(float(w)))
    ch = torch.where(fits.any(1), ch.gather(1, first).squeeze(1), torch.tensor(float(h)))
    x0 = torch.floor(torch.rand(n, generator=gen) * (w - cw + 1))
    y0 = torch.floor(torch.rand(n, generator=gen) * (h - ch + 1))
    zero = torch.zeros(n)
    theta = torch.stack([torch.stack([cw / w, zero, (2 * x0 + cw) / w - 1], 1),
                         torch.stack([zero, ch / h, (2 * y0 + ch) / h - 1], 1)], 1)
    return {"theta": theta}


#: torchvision's RandomResizedCrop, batched: per image up to 10 draws of an area fraction U(0.2, 1) and a
#: log-uniform aspect ratio in [3/4, 4/3], the first that fits (else the whole image), placed uniformly, resized
#: bilinearly back
random_resized_crop = Augmentation(_draw_resized_crop, lambda x, d: _warp(x, d["theta"], "bilinear"))


def _draw_rotate(n: int, h: int, w: int, gen: torch.Generator, degrees: float = 15.0) -> Draws:
    angle = torch.deg2rad((2 * torch.rand(n, generator=gen) - 1) * degrees)
    cos, sin, zero = angle.cos(), angle.sin(), torch.zeros(n)
    return {"theta": torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)}


#: torchvision's RandomRotation(15), batched: an angle U(-15, 15) degrees per image about the centre,
#: nearest-neighbour resampling, black fill
rotate = Augmentation(_draw_rotate, lambda x, d: _warp(x, d["theta"], "nearest"))


def _grey(x: Tensor) -> Tensor:
    """Luma (B,1,H,W) of RGB images."""
    r, g, b = x.unbind(1)
    return (GREY[0] * r + GREY[1] * g + GREY[2] * b).unsqueeze(1)


def _draw_grayscale(n: int, h: int, w: int, gen: torch.Generator, p: float = 0.2) -> Draws:
    return {"mask": torch.rand(n, generator=gen) < p}


def _apply_grayscale(x: Tensor, d: Draws) -> Tensor:
    mask = on_device(d["mask"], x).view(-1, 1, 1, 1)
    return torch.where(mask, _grey(x).expand_as(x), x)


#: each image turned grey (luma in all three channels) with probability 0.2
random_grayscale = Augmentation(_draw_grayscale, _apply_grayscale)


def _rgb_to_hsv(x: Tensor) -> Tensor:
    """RGB in [0, 1] -> HSV in [0, 1] (torchvision's tensor formulas)."""
    r, g, b = x.unbind(1)
    maxc, minc = x.max(dim=1).values, x.min(dim=1).values
    cr = maxc - minc
    s = cr / torch.where(maxc == 0, torch.ones_like(maxc), maxc)
    crd = torch.where(cr == 0, torch.ones_like(cr), cr)
    rc, gc, bc = (maxc - r) / crd, (maxc - g) / crd, (maxc - b) / crd
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = torch.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return torch.stack([h, s, maxc], 1)


def _hsv_to_rgb(x: Tensor) -> Tensor:
    """HSV in [0, 1] -> RGB in [0, 1] (torchvision's tensor formulas)."""
    h, s, v = x.unbind(1)
    i = torch.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.to(torch.int64) % 6
    p, q, t = (v * (1.0 - s)).clamp(0, 1), (v * (1.0 - s * f)).clamp(0, 1), (v * (1.0 - s * (1.0 - f))).clamp(0, 1)
    mask = i.unsqueeze(1) == torch.arange(6, device=x.device).view(1, -1, 1, 1)
    a1 = torch.stack((v, q, p, p, t, v), 1)
    a2 = torch.stack((t, v, v, q, p, p), 1)
    a3 = torch.stack((p, p, t, v, v, q), 1)
    a4 = torch.stack((a1, a2, a3), 1)
    return torch.einsum("...ijk, ...xijk -> ...xjk", mask.to(x.dtype), a4)


def _draw_jitter(n: int, h: int, w: int, gen: torch.Generator, brightness: float = 0.4, contrast: float = 0.4,
                 saturation: float = 0.4, hue: float = 0.4) -> Draws:
    f_b, f_c, f_s = (_uniform(n, max(0.0, 1 - s), 1 + s, gen) for s in (brightness, contrast, saturation))
    return {"brightness": f_b, "contrast": f_c, "saturation": f_s, "hue": _uniform(n, -hue, hue, gen)}


def _apply_jitter(x: Tensor, d: Draws) -> Tensor:
    f_b, f_c, f_s = (on_device(d[k], x).view(-1, 1, 1, 1) for k in ("brightness", "contrast", "saturation"))
    shift = on_device(d["hue"], x).view(-1, 1, 1)
    x = (x * f_b).clamp(0, 1)
    mean = _grey(x).mean(dim=(1, 2, 3), keepdim=True)
    x = (f_c * x + (1 - f_c) * mean).clamp(0, 1)
    x = (f_s * x + (1 - f_s) * _grey(x)).clamp(0, 1)
    hsv = _rgb_to_hsv(x)
    hsv = torch.stack([torch.remainder(hsv[:, 0] + shift, 1.0), hsv[:, 1], hsv[:, 2]], 1)
    return _hsv_to_rgb(hsv)


#: torchvision's ColorJitter(0.4, 0.4, 0.4, 0.4), batched, factors drawn per image: brightness, contrast and
#: saturation factors U(0.6, 1.4) (blends with black, the image's mean luma, its grey image), hue shift U(-0.4, 0.4).
#: The four are applied in this fixed order (torchvision draws a random order per image; DEVIATIONS.md, FedPFT).
color_jitter = Augmentation(_draw_jitter, _apply_jitter)

_MOCO_V1 = (("crop", random_resized_crop), ("grey", random_grayscale), ("jitter", color_jitter), ("flip", flip))


def _draw_moco_v1(n: int, h: int, w: int, gen: torch.Generator) -> Draws:
    return {k: aug.draw(n, h, w, gen) for k, aug in _MOCO_V1}  # in order: the generator's sequence of draws


def _apply_moco_v1(x: Tensor, d: Draws) -> Tensor:
    for k, aug in _MOCO_V1:
        x = aug.apply(x, d[k])
    return x


#: MoCo v1's view (its main_moco.py without --aug-plus): RandomResizedCrop(scale 0.2-1), RandomGrayscale(0.2),
#: ColorJitter(0.4, 0.4, 0.4, 0.4), RandomHorizontalFlip, in that order
moco_v1 = Augmentation(_draw_moco_v1, _apply_moco_v1)


#: name -> augmentation of a model-ready NCHW batch; methods name them in ``augment``
AUGMENTATIONS: dict[str, Augmentation] = {"flip": flip, "crop_flip": crop_flip}
#: name -> augmentation of NCHW images in [0, 1]: applied between un- and re-normalisation by ``InputPipeline``
#: (colour changes and black fills are defined on pixels)
PIXEL_AUGMENTATIONS: dict[str, Augmentation] = {"moco_v1": moco_v1, "rotate15": rotate}


class InputPipeline:
    """Turns uint8 image batches into the backbone's input (size, mean/std), optionally augmented."""

    def __init__(self, img_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.img_size, self.mean, self.std = img_size, mean, std

    def __call__(self, x_uint8: Tensor) -> Tensor:
        """Model input for a uint8 (B,H,W,3) batch."""
        return to_model_input(x_uint8, self.img_size, self.mean, self.std)

    def batch(self, split: DeviceSplit, idx: Tensor, augment: tuple[str, ...] = (),
              generator: torch.Generator | None = None) -> Batch:
        """The batch of rows ``idx``: cached features if present, else model-ready (augmented) images."""
        if split.features is not None:
            x = split.features[idx]
        else:
            x = self(split.x[idx])
            for name in augment:
                x = self.augment(x, name, generator)
        return Batch(x, split.y[idx], idx, {k: v[idx] for k, v in split.extras.items()})

    def augment(self, x: Tensor, name: str, generator: torch.Generator) -> Tensor:
        """The augmentation ``name`` of a model-ready batch (a pixel-space one on its un-normalised pixels)."""
        return self.apply(x, name, self.draw(name, x.shape, generator))

    @staticmethod
    def draw(name: str, shape: Sequence[int], generator: torch.Generator) -> Draws:
        """The random draws of augmentation ``name`` for a batch of ``shape`` (N, C, H, W), from ``generator``."""
        aug = AUGMENTATIONS.get(name) or PIXEL_AUGMENTATIONS[name]
        return aug.draw(shape[0], shape[-2], shape[-1], generator)

    def apply(self, x: Tensor, name: str, draws: Draws) -> Tensor:
        """Augmentation ``name`` of a model-ready batch with its ``draws`` (rows of several clients' draws may be
        concatenated along with their images)."""
        if name in AUGMENTATIONS:
            return AUGMENTATIONS[name].apply(x, draws)
        mean = torch.tensor(self.mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        return (PIXEL_AUGMENTATIONS[name].apply(x * std + mean, draws) - mean) / std


def check_augment(names: tuple[str, ...], where: str) -> None:
    """Every named augmentation must exist."""
    unknown = [n for n in names if n not in AUGMENTATIONS and n not in PIXEL_AUGMENTATIONS]
    if unknown:
        raise ValueError(f"{where}: unknown augmentation(s) {unknown}; known: "
                         f"{sorted(AUGMENTATIONS) + sorted(PIXEL_AUGMENTATIONS)}")


@torch.no_grad()
def cache_features(split: DeviceSplit, extractor: Callable[[Tensor], Tensor], pipeline: InputPipeline,
                   batch_size: int) -> DeviceSplit:
    """A copy of ``split`` carrying ``extractor``'s features of every image (computed once per run)."""
    idx = torch.arange(len(split.y), device=split.y.device)
    feats = [extractor(pipeline(split.x[i])).float() for i in idx.split(batch_size)]
    return split.with_features(torch.cat(feats) if feats else None)


def iterate_batches(split: DeviceSplit, indices: Tensor, batch_size: int, pipeline: InputPipeline,
                    generator: torch.Generator | None = None, augment: tuple[str, ...] = (),
                    min_batch: int = 1) -> Iterator[Batch]:
    """Batches over ``indices``, shuffled (and augmented) by ``generator`` when given (training), in order otherwise;
    a last batch smaller than ``min_batch`` is skipped."""
    if generator is not None:
        order = indices[on_device(torch.randperm(len(indices), generator=generator), indices)]
    else:
        order = indices
        augment = ()
    for start in range(0, len(order), batch_size):
        if len(order) - start < min_batch:
            return
        yield pipeline.batch(split, order[start:start + batch_size], augment, generator)
