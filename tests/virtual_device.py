"""A second device on a CPU-only machine, for tests: CPU tensors that say they live on ``meta``.

Inside :class:`OnVirtualDevice`, ``.to("meta")`` and factory calls with ``device="meta"`` give :class:`Elsewhere`
tensors: real CPU data (so values can be read, counted, sorted: ``item``, ``bincount``, ``nonzero``) whose device is
``meta``. Every operation that meets an ``Elsewhere`` tensor and a plain CPU tensor with more than one element raises
torch's own "Expected all tensors to be on the same device" error, as CUDA does with a CPU tensor (0-dim CPU tensors
mix, as on CUDA). So code that would leave state on the CPU beside CUDA tensors fails here the same way, without a GPU.

``OnVirtualDevice(strict=True)`` also refuses what CUDA refuses beyond mixing: ``.numpy()`` of a tensor on the device
(CUDA: "can't convert cuda:0 device type tensor to numpy") and a CPU ``torch.Generator`` drawing a tensor on the device
(CUDA: "Expected a 'cuda' device type for generator"); a generator made for the device is marked and accepted.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing

VIRTUAL = torch.device("meta")
_CPU = torch.device("cpu")


class Elsewhere(torch.Tensor):
    """A CPU tensor whose device reads ``meta``."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "Elsewhere":
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                   storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                   device=VIRTUAL, layout=inner.layout,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"Elsewhere({self.inner!r})"

    def tolist(self):  # noqa: D102 - torch refuses tolist() on subclasses
        return self.inner.tolist()

    def numpy(self, *args, **kwargs):  # noqa: D102
        if _STRICT:
            raise TypeError(f"can't convert {VIRTUAL} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first. (tests/virtual_device.py, strict: CUDA's error)")
        return self.inner.numpy(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return Elsewhere(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


# copies between devices are allowed, as torch allows them between the CPU and CUDA
_CROSSING = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


# advanced indexing takes CPU index tensors on CUDA too (x[cpu_long], x[cpu_long] = v)
_CPU_INDICES = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                torch.ops.aten._index_put_impl_.default)


def _virtual(device) -> bool:
    return device is not None and torch.device(device).type == VIRTUAL.type


_STRICT: list[bool] = []  # non-empty while a strict OnVirtualDevice is active


def _check_generator(generator, on_device: bool) -> None:
    """Strict mode: a CPU generator may not draw a tensor on the device (CUDA refuses it)."""
    if _STRICT and on_device and generator is not None and not getattr(generator, "virtual", False):
        raise RuntimeError(f"Expected a '{VIRTUAL.type}' device type for generator but found 'cpu' "
                           "(tests/virtual_device.py, strict: CUDA's error)")


def _run(func, args, kwargs):
    flat = pytree.tree_leaves((args, kwargs))
    virt = any(isinstance(t, Elsewhere) for t in flat)
    to_virtual = _virtual(kwargs.get("device"))
    _check_generator(kwargs.get("generator"), virt or to_virtual)
    copy = func is torch.ops.aten._to_copy.default
    unwrapped_args = pytree.tree_map_only(Elsewhere, lambda t: t.inner, args)
    unwrapped_kwargs = pytree.tree_map_only(Elsewhere, lambda t: t.inner, kwargs)
    if copy and virt and "device" in kwargs and not to_virtual:  # leaving the device: a plain tensor
        return func(*unwrapped_args, **unwrapped_kwargs)
    plain = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, Elsewhere) and t.dim() > 0
             and not (func in _CPU_INDICES and not t.is_floating_point())]
    if virt and plain and func not in _CROSSING:
        raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                           f"{VIRTUAL} and cpu! (in {func}; {VIRTUAL} plays the GPU: tests/virtual_device.py)")
    if to_virtual:
        unwrapped_kwargs = {**unwrapped_kwargs, "device": _CPU}
    out = func(*unwrapped_args, **unwrapped_kwargs)
    if not (virt or to_virtual):
        return out
    out = pytree.tree_map_only(torch.Tensor, lambda t: t if isinstance(t, Elsewhere) else Elsewhere(t), out)
    return return_and_correct_aliasing(func, args, kwargs, out)


_TorchGenerator = torch.Generator


class _Generator(_TorchGenerator):
    """A random generator asked for on the virtual device: a CPU one (no kernel runs off the CPU here)."""

    def __new__(cls, device="cpu"):
        gen = _TorchGenerator.__new__(cls, _CPU if _virtual(device) else device)
        gen.virtual = _virtual(device)
        return gen


class _Factories(TorchFunctionMode):
    """``torch.tensor(data, device="meta")`` and its kind build their tensor without a dispatched op (no mode sees it):
    build it on the CPU and wrap it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _virtual(kwargs.get("device")):
            return func(*args, **kwargs)
        _check_generator(kwargs.get("generator"), True)
        out = func(*args, **{**kwargs, "device": _CPU})
        return pytree.tree_map_only(torch.Tensor, lambda t: t if isinstance(t, Elsewhere) else Elsewhere(t), out)


_TorchAutocast = torch.autocast


class _Autocast(_TorchAutocast):
    """``torch.autocast("meta", ...)`` (which torch refuses) as the CPU's: the virtual device's tensors are CPU data."""

    def __init__(self, device_type: str, *args, **kwargs) -> None:
        super().__init__("cpu" if device_type == VIRTUAL.type else device_type, *args, **kwargs)


class OnVirtualDevice(TorchDispatchMode):
    """Within the block ``meta`` is a second device holding real data (see the module's docstring); ``strict``: it
    also refuses ``.numpy()`` and CPU generators as CUDA does."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict

    def __enter__(self):
        if self.strict:
            _STRICT.append(True)
        torch.Generator = _Generator
        torch.autocast = _Autocast
        self._factories = _Factories()
        self._factories.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Generator = _TorchGenerator
        torch.autocast = _TorchAutocast
        out = super().__exit__(*exc)
        self._factories.__exit__(*exc)
        if self.strict:
            _STRICT.pop()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})
