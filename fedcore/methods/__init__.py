"""Method registry, as timm registers its models: a method is the ``Method`` subclass of fedcore/methods/<name>.py that
carries ``@register_method``, and its ``name`` is its file's name.

``method_class(name)`` imports that one module (a run imports its own method's code and no other method's, which
keeps its code inputs exact: fedcore/code_inputs.py); ``method_names()`` imports every module of this package once
to list the registered methods (configuration checks, the report).
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # the registry itself needs no engine: the report asks it which methods exist
    from fedcore.engine.roles import Method

M = TypeVar("M", bound="type[Method]")

_REGISTERED: dict[str, type[Method]] = {}
_found = False  # whether every module of the package was imported (method_names)


def register_method(cls: M) -> M:
    """Class decorator: register ``cls`` as the method named ``cls.name``, which must be its module's name."""
    module = cls.__module__.rpartition(".")[2]
    if cls.__module__ != f"{__name__}.{module}" or getattr(cls, "name", None) != module:
        raise TypeError(f"{cls.__qualname__}: a registered method lives in fedcore/methods/<name>.py and is named "
                        f"<name>; got name {getattr(cls, 'name', None)!r} in module {cls.__module__}")
    other = _REGISTERED.get(module)
    if other is not None and other is not cls:
        raise TypeError(f"fedcore/methods/{module}.py registers two methods: {other.__qualname__} and {cls.__qualname__}")
    _REGISTERED[module] = cls
    return cls


def method_module(name: str) -> str:
    """The module that holds method ``name`` (imported by name: a code input of the jobs that run it)."""
    if not name.isidentifier() or importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise ValueError(f"unknown method {name!r}; known methods: {method_names()}")
    return f"{__name__}.{name}"


def method_class(name: str) -> type[Method]:
    """The Method subclass registered under ``name`` (its module is imported on first use)."""
    if name not in _REGISTERED:
        importlib.import_module(method_module(name))
        if name not in _REGISTERED:
            raise ValueError(f"unknown method {name!r}: fedcore/methods/{name}.py registers no method "
                             f"(@register_method); known methods: {method_names()}")
    return _REGISTERED[name]


def method_names() -> list[str]:
    """Every registered method, sorted (each module of this package is imported once to find them)."""
    global _found
    if not _found:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
        _found = True
    return sorted(_REGISTERED)


def is_method(name: str) -> bool:
    """Whether ``name`` is a registered method (not a variant, not a helper module such as base or ot)."""
    return name in method_names()
