"""Deterministic kernels on CUDA, so that the same config and seed give the same numbers there as on the CPU.

CPU kernels already are deterministic: a CPU run is bit-exact across reruns on one machine. On CUDA several default
kernels are not: atomic adds in the backward of indexing, gathers and embeddings (the one-pass step gathers each
sample's prompts by client index), the fused attention kernels' backward (torch's flash and memory-efficient SDPA
take their deterministic backward only in strict mode, ``use_deterministic_algorithms(True)`` without
``warn_only``), and cuBLAS without a fixed workspace. :func:`deterministic_kernels` puts a CUDA job in strict mode:
every op takes its deterministic kernel, and an op that has none raises at its first call, naming itself, so a run
is either reproducible or stops at once with the reason. ``deterministic: false`` in the config allows the faster
kernels instead (the numbers may then differ in the last bits from one rerun to the next).

CI has no GPU: :func:`strict_refusal` lists the calls that strict mode refuses on CUDA (torch's list in
``torch.use_deterministic_algorithms``, restricted to what a model can call), and the CPU proxy of CUDA's rules
(``fedcore.engine.precision.cuda_rules_on_cpu``) raises on them, so a method that would stop on a GPU stops in the
tests first.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
import torch.utils.deterministic
from torch import Tensor

#: cuBLAS's deterministic workspace (torch's reproducibility notes: ':4096:8' or ':16:8'); read when cuBLAS starts
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def prepare_cuda_determinism() -> None:
    """Give cuBLAS a fixed workspace (CUBLAS_WORKSPACE_CONFIG) unless the user set one; call before CUDA starts."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)


@contextlib.contextmanager
def deterministic_kernels(device: torch.device | str, on: bool = True) -> Iterator[None]:
    """Within the block a job on CUDA (with ``on``) runs deterministic kernels only, in torch's strict mode; nothing
    changes on the CPU. The caller's settings are restored afterwards."""
    if not on or torch.device(device).type != "cuda":
        yield
        return
    prepare_cuda_determinism()
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.benchmark)
    try:
        torch.use_deterministic_algorithms(True, warn_only=False)
        # NaN-filling every torch.empty is a debugging aid of deterministic mode, not needed for equal numbers
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.benchmark = False  # benchmarking picks cuDNN algorithms by timing, run to run
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]
        torch.backends.cudnn.benchmark = before[3]


def _grad(*xs: Any) -> bool:
    """Whether any of ``xs`` is a tensor autograd differentiates (the refusals below are of backward kernels)."""
    return any(isinstance(x, Tensor) and x.requires_grad for x in xs)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``name``) of a call."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def _pool_to_one(size: Any) -> bool:
    """An adaptive pool to 1x1: torch computes it as a mean over the spatial dims (a deterministic backward)."""
    sizes = size if isinstance(size, (tuple, list)) else (size,)
    return all(s == 1 for s in sizes)


def _over_positions(x: Any) -> bool:
    """A loss input with spatial positions beyond (N, C): torch's nll_loss2d path."""
    return isinstance(x, Tensor) and x.dim() > 2


def _floating_cumsum(a: tuple, k: dict) -> bool:
    """A cumulative sum in a floating or complex dtype (its CUDA kernel is deterministic from torch 2.14 on only)."""
    x, dtype = _arg(a, k, 0, "input"), _arg(a, k, 2, "dtype")
    dtype = dtype if dtype is not None else (x.dtype if isinstance(x, Tensor) else None)
    return dtype is not None and (dtype.is_floating_point or dtype.is_complex)


# call -> (why strict mode refuses it on CUDA, whether this call is refused): the calls models make, from torch's list
# in every release pyproject.toml admits (2.11 to 2.14: 2.14 made cumsum and max_pool3d's backward deterministic, so a
# method using them would still stop on a GPU site's torch 2.11-2.13)
_REFUSED: dict[Callable, tuple[str, Callable[[tuple, dict], bool]]] = {
    F.interpolate: ("interpolate's linear/bilinear/bicubic/trilinear backward",
                    lambda a, k: _arg(a, k, 3, "mode", "nearest") in ("linear", "bilinear", "bicubic", "trilinear")
                    and _grad(_arg(a, k, 0, "input"))),
    F.grid_sample: ("grid_sample's backward", lambda a, k: _grad(_arg(a, k, 0, "input"), _arg(a, k, 1, "grid"))),
    F.adaptive_avg_pool2d: ("adaptive_avg_pool2d's backward (other than to 1x1)",
                            lambda a, k: _grad(_arg(a, k, 0, "input"))
                            and not _pool_to_one(_arg(a, k, 1, "output_size"))),
    F.adaptive_avg_pool3d: ("adaptive_avg_pool3d's backward", lambda a, k: _grad(_arg(a, k, 0, "input"))),
    F.adaptive_max_pool2d: ("adaptive_max_pool2d's backward", lambda a, k: _grad(_arg(a, k, 0, "input"))),
    F.avg_pool3d: ("avg_pool3d's backward", lambda a, k: _grad(_arg(a, k, 0, "input"))),
    F.max_pool3d: ("max_pool3d's backward (torch < 2.14)", lambda a, k: _grad(_arg(a, k, 0, "input"))),
    torch.cumsum: ("cumsum in a floating dtype (torch < 2.14)", _floating_cumsum),
    Tensor.cumsum: ("cumsum in a floating dtype (torch < 2.14)", _floating_cumsum),
    Tensor.cumsum_: ("cumsum in a floating dtype (torch < 2.14)", _floating_cumsum),
    F.max_unpool1d: ("max_unpool1d", lambda a, k: True),
    F.max_unpool2d: ("max_unpool2d", lambda a, k: True),
    F.max_unpool3d: ("max_unpool3d", lambda a, k: True),
    F.pad: ("reflection padding's backward",
            lambda a, k: _arg(a, k, 2, "mode", "constant") == "reflect" and _grad(_arg(a, k, 0, "input"))),
    F.nll_loss: ("nll_loss over spatial positions (nll_loss2d)",
                 lambda a, k: _over_positions(_arg(a, k, 0, "input")) and _arg(a, k, 6, "reduction", "mean") != "none"),
    F.cross_entropy: ("cross_entropy over spatial positions (nll_loss2d)",
                      lambda a, k: _over_positions(_arg(a, k, 0, "input"))
                      and _arg(a, k, 6, "reduction", "mean") != "none"),
    F.ctc_loss: ("ctc_loss's backward", lambda a, k: _grad(_arg(a, k, 0, "log_probs"))),
    torch.histc: ("histc", lambda a, k: True),
    Tensor.histc: ("histc", lambda a, k: True),
    torch.bincount: ("bincount with weights", lambda a, k: _arg(a, k, 1, "weights") is not None),
    Tensor.bincount: ("bincount with weights", lambda a, k: _arg(a, k, 1, "weights") is not None),
    torch.median: ("median with indices", lambda a, k: _arg(a, k, 1, "dim") is not None),
    Tensor.median: ("median with indices", lambda a, k: _arg(a, k, 1, "dim") is not None),
    Tensor.put_: ("put_", lambda a, k: True),
    Tensor.put: ("put", lambda a, k: True),
}


def strict_refusal(func: Callable, args: tuple, kwargs: dict) -> str | None:
    """Why CUDA's strict deterministic mode refuses this call (no deterministic kernel), or None if it runs."""
    entry = _REFUSED.get(func)
    if entry is None:
        return None
    why, refused = entry
    return why if refused(args, kwargs) else None
