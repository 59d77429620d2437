"""Partition schemes registered by name: a scheme is one function of a module of fedcore/partition/schemes/ under
``@register_scheme(name, keys=..., test_modes=...)``, as a method is one class under ``@register_method``.

The registry finds the schemes by importing every module of that package once, on the first look-up, so a new
scheme is a new function (or module) there and nothing else. What a scheme declares:

  keys        its spec keys and their defaults (REQUIRED: no default), ``test`` among them
  test_modes  the local-test rules it accepts under ``test``; the first one is the default
  draw        ``draw(spec, labels, rng) -> (train, test)``: per-client index lists, all randomness from ``rng``
  needs       label arrays besides the classes (``domain``, ``coarse``) that make_partition must be given
  check       checks across its keys (ValueError), after every key was checked alone
  limits      what a validated spec asks of a dataset that its static facts say it cannot give
  random_alpha        whether ``alpha: random`` is allowed (FedHPL's random alpha)
  omitted_at_default  keys added after its partitions were in use: left out of the validated spec while they hold
                      their default, so the ids and files of the earlier specs stay byte-identical
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fedcore.constraints import Violation
from fedcore.data.facts import DatasetFacts

REQUIRED = "<required>"  # marker in a scheme's keys for keys without a default (a string so the keys stay JSON-able)
SCHEMES_PACKAGE = "fedcore.partition.schemes"


@dataclass(frozen=True)
class Labels:
    """The label arrays a partition is drawn from: classes of both splits, and domains or coarse classes when the
    scheme needs them (checked 1-D integer arrays, one entry per sample)."""

    train_y: np.ndarray
    test_y: np.ndarray
    train_domain: np.ndarray | None = None
    test_domain: np.ndarray | None = None
    train_coarse: np.ndarray | None = None
    test_coarse: np.ndarray | None = None


Draw = Callable[[dict, Labels, np.random.Generator], tuple[list[np.ndarray], list[np.ndarray]]]
Limits = Callable[[dict, DatasetFacts, str], list[Violation]]


@dataclass(frozen=True)
class Scheme:
    """One registered partition scheme (see the module's docstring for each field)."""

    name: str
    keys: dict[str, Any]
    test_modes: tuple[str, ...]
    draw: Draw
    needs: tuple[str, ...] = ()
    check: Callable[[dict], None] | None = None
    limits: Limits | None = None
    random_alpha: bool = False
    omitted_at_default: tuple[str, ...] = ()


_SCHEMES: dict[str, Scheme] = {}
_found = False  # whether every scheme module was imported (a test may import one alone)


def register_scheme(name: str, *, keys: dict[str, Any], test_modes: tuple[str, ...], needs: tuple[str, ...] = (),
                    check: Callable[[dict], None] | None = None, limits: Limits | None = None,
                    random_alpha: bool = False, omitted_at_default: tuple[str, ...] = ()) -> Callable[[Draw], Draw]:
    """Decorator: register the decorated draw function as partition scheme ``name``."""
    if keys.get("test") != test_modes[0]:
        raise ValueError(f"partition scheme {name!r}: its key 'test' must default to its first test mode "
                         f"{test_modes[0]!r}")

    def register(draw: Draw) -> Draw:
        if name in _SCHEMES:
            raise ValueError(f"partition scheme {name!r} is registered twice ({_SCHEMES[name].draw.__module__} and "
                             f"{draw.__module__})")
        _SCHEMES[name] = Scheme(name, dict(keys), tuple(test_modes), draw, tuple(needs), check, limits, random_alpha,
                                tuple(omitted_at_default))
        return draw

    return register


def scheme_modules() -> list[str]:
    """Every module of fedcore/partition/schemes/ (all are imported to find the schemes: a partition job's code)."""
    package = importlib.import_module(SCHEMES_PACKAGE)
    return [f"{SCHEMES_PACKAGE}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]


def schemes() -> dict[str, Scheme]:
    """Every registered scheme by name (the scheme modules are imported on the first call)."""
    global _found
    if not _found:
        for module in scheme_modules():
            importlib.import_module(module)
        _found = True
    return dict(_SCHEMES)


def scheme(name: str) -> Scheme:
    """The scheme registered as ``name``; a ValueError naming the known ones otherwise."""
    known = schemes()
    if name not in known:
        raise ValueError(f"partition key 'scheme' must be one of {sorted(known)}, got {name!r}")
    return known[name]
