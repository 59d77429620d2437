"""Client data kept on the device as uint8; batches are converted (resize, normalise) on the device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch

from fedcore.backbones.images import to_model_input
from fedcore.data.arrays import ArrayDataset


class QueryBatch(NamedTuple):
    """Model inputs plus each sample's cached Select query (for methods with ``uses_select_queries``)."""

    x: torch.Tensor
    query: torch.Tensor


@dataclass
class DeviceSplit:
    """One split's images (uint8 NHWC) and labels, resident on the run's device.

    ``features`` holds cached frozen-backbone features when the method allows it (head-only methods):
    batches are then rows of it instead of images. ``queries`` holds cached per-image Select queries
    (SGPT): batches are then ``QueryBatch(images, queries)``. ``coarse`` holds coarse labels if the
    dataset has them (CIFAR-100's 20 superclasses), for analyses such as SGPT's clustering accuracy.
    """

    x: torch.Tensor
    y: torch.Tensor
    features: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    coarse: torch.Tensor | None = None

    @classmethod
    def from_arrays(cls, ds: ArrayDataset, device: torch.device) -> "DeviceSplit":
        """Move a split to the device once; every batch after that is an index into it."""
        coarse = None if ds.coarse is None else torch.from_numpy(np.asarray(ds.coarse, dtype=np.int64)).to(device)
        return cls(torch.from_numpy(np.ascontiguousarray(ds.x)).to(device),
                   torch.from_numpy(ds.y).to(device), coarse=coarse)


class InputPipeline:
    """Turns uint8 image batches into the backbone's input (size, mean/std)."""

    def __init__(self, img_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.img_size, self.mean, self.std = img_size, mean, std

    def __call__(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """Model input for a uint8 (B,H,W,3) batch."""
        return to_model_input(x_uint8, self.img_size, self.mean, self.std)

    def batch(self, split: DeviceSplit, idx: torch.Tensor) -> torch.Tensor | QueryBatch:
        """The method's input for rows ``idx``: cached features if present, else model-ready images
        (paired with their cached Select queries when the split carries them)."""
        if split.features is not None:
            return split.features[idx]
        if split.queries is not None:
            return QueryBatch(self(split.x[idx]), split.queries[idx])
        return self(split.x[idx])


@torch.no_grad()
def cache_features(split: DeviceSplit, extractor: Callable[[torch.Tensor], torch.Tensor],
                   pipeline: InputPipeline, batch_size: int) -> DeviceSplit:
    """A copy of ``split`` carrying ``extractor``'s features of every image (computed once per run)."""
    idx = torch.arange(len(split.y), device=split.y.device)
    feats = [extractor(pipeline(split.x[i])).float() for i in idx.split(batch_size)]
    return DeviceSplit(split.x, split.y, torch.cat(feats) if feats else None, coarse=split.coarse)


def iterate_batches(split: DeviceSplit, indices: torch.Tensor, batch_size: int, pipeline: InputPipeline,
                    generator: torch.Generator | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches over ``indices``, shuffled by ``generator`` when given (training), in order otherwise."""
    if generator is not None:
        order = indices[torch.randperm(len(indices), generator=generator).to(indices.device)]
    else:
        order = indices
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        yield pipeline.batch(split, idx), split.y[idx]
