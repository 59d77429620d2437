"""Host-device syncs counted on the CPU: the ops that make a CUDA run wait for the GPU (a value read back to Python,
or an output whose shape depends on the data) dispatch on the CPU too, so a test can count them per training step."""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

A = torch.ops.aten
#: a scalar read back: ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``if t:``
SCALAR = {A._local_scalar_dense.default}
#: outputs sized by the data (CUDA reads the size back first; bincount reads its input's max)
SHAPE = {A.nonzero.default, A.argwhere.default, A.masked_select.default, A.bincount.default, A._unique2.default,
         A.unique_dim.default, A.unique_consecutive.default, A.repeat_interleave.Tensor}


class HostSyncs(TorchDispatchMode):
    """Within the block, ``counts`` gathers the ops that sync on CUDA ("scalar", or the shape op's name; boolean-mask
    indexing counts as "bool_index"; a copy between devices that waits, "blocking_copy")."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        """All syncs counted."""
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCALAR:
            self.counts["scalar"] += 1
        elif func in SHAPE:
            self.counts[func.__name__] += 1
        elif func is A._to_copy.default and "device" in (kwargs or {}) and not (kwargs or {}).get("non_blocking"):
            if torch.device(kwargs["device"]) != args[0].device:  # a blocking copy waits for the device's queue
                self.counts["blocking_copy"] += 1
        elif func in (A.index.Tensor, A.index_put_.default, A.index_put.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
                self.counts["bool_index"] += 1
        return func(*args, **(kwargs or {}))
