"""Mixed precision, and the device whose rules the engine's device-dependent choices follow.

Training and evaluation run under bf16 autocast on CUDA (the frozen backbone dominates the cost) and in full
precision on the CPU, which keeps CPU runs bit-exact (``AUTOCAST``). The engine's other choices that depend on the
device (``Client.together``: which path a round's clients take, one pass or vmap; FedPFT's ``client_batching:
auto``) ask :func:`rules_device`.

CI has no GPU, so :func:`cuda_rules_on_cpu` lets a test meet on the CPU what only CUDA's rules raise: every choice is
made as on CUDA, autocast is on (bf16), and the ops CUDA's autocast runs in bf16 get bf16 inputs even where the CPU's
autocast does not cast them (inside vmap it does not: on the CPU a vmapped convolution stays fp32 under autocast,
on CUDA it is bf16, and the BatchNorm after it then refused fp32 running statistics: a crash no CPU run showed), and,
as the pipeline's CUDA jobs run in strict deterministic mode (``fedcore.runtime.determinism``), a call that has no
deterministic CUDA kernel raises as it would there.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from fedcore.runtime.determinism import strict_refusal

#: the autocast dtype of each device type (None: full precision)
AUTOCAST: dict[str, torch.dtype | None] = {"cuda": torch.bfloat16, "cpu": None}
_RULES: list[str] = []  # the device type whose rules apply, while cuda_rules_on_cpu is active


def rules_device(t: Tensor) -> str:
    """The device type whose rules the engine follows for ``t``: its own, or CUDA's under :func:`cuda_rules_on_cpu`."""
    return _RULES[-1] if _RULES else t.device.type


def autocast_for(x: Tensor) -> torch.autocast:
    """The autocast block of ``x``'s device type (``AUTOCAST``): bf16 on CUDA, a no-op on the CPU."""
    dtype = AUTOCAST.get(x.device.type)
    return torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


# what CUDA's autocast runs in its lower precision (torch/amp/autocast_mode.py's CUDA list, the functions models here call)
_CUDA_LOWER = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.linear,
               F.scaled_dot_product_attention, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
               torch.einsum, Tensor.matmul, Tensor.__matmul__, Tensor.mm, Tensor.bmm}


class _CudaCalls(TorchFunctionMode):
    """bf16 inputs for the ops in CUDA's autocast list while CPU autocast is on, also inside vmap; with
    ``deterministic``, a call that CUDA's strict deterministic mode refuses raises."""

    def __init__(self, deterministic: bool) -> None:
        super().__init__()
        self.deterministic = deterministic

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = strict_refusal(func, args, kwargs) if self.deterministic else None
        if why is not None:
            raise RuntimeError(f"{why} has no deterministic CUDA kernel: a CUDA job in strict deterministic mode "
                               "(config deterministic: true) stops here; use another op, or set deterministic: false")
        if func in _CUDA_LOWER and torch.is_autocast_enabled("cpu"):
            def cast(a):
                return a.to(torch.bfloat16) if isinstance(a, Tensor) and a.is_floating_point() else a
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_rules_on_cpu(deterministic: bool = True) -> Iterator[None]:
    """Within the block the CPU plays CUDA's rules: its choices, bf16 autocast, bf16 where CUDA's autocast casts and
    (``deterministic``, the config's default) strict mode's refusals (a test's proxy for the GPU, where CI has none)."""
    before = AUTOCAST["cpu"]
    AUTOCAST["cpu"] = torch.bfloat16
    _RULES.append("cuda")
    try:
        with _CudaCalls(deterministic):
            yield
    finally:
        _RULES.pop()
        AUTOCAST["cpu"] = before
