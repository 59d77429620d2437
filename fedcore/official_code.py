"""The papers' and baselines' official code, imported from a local checkout for side-by-side checks, never copied.

Their top-level module names are generic (``utils``, ``models``, ``engine``, ``clip``, ``flcore``), so a checkout is
first on ``sys.path`` only inside :func:`checkout_on_path`. On leaving, ``sys.path``, the modules under those names
and bytecode writing are as before: neither our packages, another checkout's modules of the same names nor a later
test see them, and nothing is written into the checkout. Used by ``tests/test_official_*.py`` and
``fedcore/official_sgpt.py`` (``benchmarks/bench_sgpt_official.py``).
"""
from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any


def standin_modules(spec: Mapping[str, Mapping[str, Any]]) -> dict[str, ModuleType]:
    """Modules standing in for what only a checkout's harness imports: module name -> its attributes."""
    mods = {}
    for name, attrs in spec.items():
        mods[name] = ModuleType(name)
        mods[name].__dict__.update(attrs)
    return mods


@contextmanager
def checkout_on_path(root: str | Path, names: Iterable[str],
                     standins: Mapping[str, ModuleType] | None = None) -> Iterator[None]:
    """``root`` first on sys.path with ``standins`` registered (each given a module spec); every module whose
    top-level name is in ``names`` (or is a stand-in's) is unregistered on entry and again on exit, where the ones
    there before come back."""
    standins = dict(standins or {})
    for name, mod in standins.items():  # torch._dynamo looks some names up with importlib.util.find_spec
        if getattr(mod, "__spec__", None) is None:
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    top = set(names) | {n.split(".")[0] for n in standins}

    def theirs(name: str) -> bool:
        return name.split(".")[0] in top

    saved = {n: m for n, m in sys.modules.items() if theirs(n)}
    path, no_pyc = list(sys.path), sys.dont_write_bytecode
    try:
        for name in saved:
            del sys.modules[name]
        sys.modules.update(standins)
        sys.path.insert(0, str(root))
        sys.dont_write_bytecode = True  # leave their checkout as it is
        yield
    finally:
        for name in [n for n in sys.modules if theirs(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
        sys.path[:] = path
        sys.dont_write_bytecode = no_pyc
