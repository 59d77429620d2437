"""Declarative limits on config values, checked when the config loads, before any job runs.

A method declares one constraint per param (``Method.param_rules``: ``Int``, ``Number``, ``Choice``,
``Flag``, ``BlockIndex``, ``BlockList``). A limit may depend on the run (``Bound``: the backbone's width,
the partition's client count), known from static registries without building anything (``RunFacts``).
A failed check is a ``Violation``: the key, the value, what is allowed and why.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Violation", "BackboneFacts", "RunFacts", "Bound", "EMBED_DIM", "LAST_CLIENT", "Constraint", "Int",
           "Number", "Choice", "Flag", "BlockIndex", "BlockList", "violations"]


@dataclass(frozen=True)
class Violation:
    """One refused value: ``key`` = ``value``, what is ``allowed`` and ``because`` of what."""

    key: str
    value: Any
    allowed: str
    because: str = ""

    def __str__(self) -> str:
        why = f" ({self.because})" if self.because else ""
        return f"key {self.key!r} = {self.value!r}: allowed {self.allowed}{why}"


@dataclass(frozen=True)
class BackboneFacts:
    """A backbone's static facts (registry data: nothing is built)."""

    name: str
    arch: str
    depth: int  # blocks (ViT) or stages (ResNet) prompts can address
    dim: int    # feature dim (ViT: embed dim)


@dataclass(frozen=True)
class RunFacts:
    """What one run's params are checked against: its backbones, dataset and number of clients."""

    backbones: tuple[BackboneFacts, ...]
    dataset: str
    classes: int
    clients: int

    def shallowest(self) -> BackboneFacts:
        """The backbone with the fewest blocks (a block index must exist in every backbone of the run)."""
        return min(self.backbones, key=lambda b: b.depth)

    def narrowest(self) -> BackboneFacts:
        """The backbone with the smallest feature dim."""
        return min(self.backbones, key=lambda b: b.dim)


@dataclass(frozen=True)
class Bound:
    """A limit that depends on the run: ``of(facts)`` gives (value, why)."""

    of: Callable[[RunFacts], tuple[int, str]]


def _embed_dim(f: RunFacts) -> tuple[int, str]:
    b = f.narrowest()
    return b.dim, f"backbone {b.name} has feature dim {b.dim}"


def _last_client(f: RunFacts) -> tuple[int, str]:
    return f.clients - 1, f"the partition has {f.clients} clients"


EMBED_DIM = Bound(_embed_dim)      # the narrowest backbone's feature dim
LAST_CLIENT = Bound(_last_client)  # the partition's last client id


class Constraint:
    """A check of one param's value; ``facts`` None checks only what needs no run (a method built directly)."""

    def violation(self, key: str, value: Any, facts: RunFacts | None) -> Violation | None:
        """None when ``value`` is allowed, else the Violation."""
        raise NotImplementedError


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _resolve(limit: int | Bound | None, facts: RunFacts | None) -> tuple[int | None, str]:
    """A limit's value and reason (a Bound without facts: no limit)."""
    if isinstance(limit, Bound):
        return limit.of(facts) if facts is not None else (None, "")
    return limit, ""


@dataclass(frozen=True)
class Int(Constraint):
    """An integer in lo..hi (inclusive; hi None: no upper limit); ``optional``: null is allowed too."""

    lo: int = 0
    hi: int | Bound | None = None
    optional: bool = False

    def violation(self, key: str, value: Any, facts: RunFacts | None) -> Violation | None:
        """See Constraint."""
        if value is None and self.optional:
            return None
        lo = self.lo
        hi, why = _resolve(self.hi, facts)
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        ok = _is_int(value) and value >= lo and (hi is None or value <= hi)
        if ok:
            return None
        allowed = span if _is_int(value) else f"an integer {span}"
        allowed = f"null or {allowed}" if self.optional else allowed
        return Violation(key, value, allowed, why)


@dataclass(frozen=True)
class Number(Constraint):
    """A finite number in an interval (open or closed at each end; None: unbounded)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    optional: bool = False

    def violation(self, key: str, value: Any, facts: RunFacts | None) -> Violation | None:
        """See Constraint."""
        if value is None and self.optional:
            return None
        ok = _is_number(value)
        if ok and self.lo is not None:
            ok = value > self.lo if self.lo_open else value >= self.lo
        if ok and self.hi is not None:
            ok = value < self.hi if self.hi_open else value <= self.hi
        if ok:
            return None
        if self.hi is None:
            span = f"{'>' if self.lo_open else '>='} {self.lo}" if self.lo is not None else "any number"
        else:
            span = f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        return Violation(key, value, f"null or {span}" if self.optional else span)


@dataclass(frozen=True)
class Choice(Constraint):
    """One of fixed values."""

    values: tuple[Any, ...]

    def violation(self, key: str, value: Any, facts: RunFacts | None) -> Violation | None:
        """See Constraint."""
        return None if value in self.values else Violation(key, value, f"one of {list(self.values)}")


@dataclass(frozen=True)
class Flag(Constraint):
    """true or false."""

    def violation(self, key: str, value: Any, facts: RunFacts | None) -> Violation | None:
        """See Constraint."""
        return None if isinstance(value, bool) else Violation(key, value, "true or false")


def _blocks(facts: RunFacts | None) -> tuple[int | None, str]:
    """The largest block index every backbone of the run has, and why."""
    if facts is None:
        return None, ""
    b = facts.shallowest()
    return b.depth - 1, f"backbone {b.name} has {b.depth} blocks"


@dataclass(frozen=True)
class BlockIndex(Constraint):
    """One block of the backbone: 0..depth-1 (in every backbone of the run)."""

    def violation(self, key: str, value: Any, facts: RunFacts | None) -> Violation | None:
        """See Constraint."""
        last, why = _blocks(facts)
        if _is_int(value) and value >= 0 and (last is None or value <= last):
            return None
        span = f"0..{last}" if last is not None else ">= 0"
        return Violation(key, value, span if _is_int(value) else f"a block index {span}", why)


@dataclass(frozen=True)
class BlockList(Constraint):
    """Distinct blocks of the backbone, each in 0..depth-1 (the list may be empty)."""

    def violation(self, key: str, value: Any, facts: RunFacts | None) -> Violation | None:
        """See Constraint."""
        last, why = _blocks(facts)
        span = f"0..{last}" if last is not None else ">= 0"
        allowed = f"a list of distinct blocks in {span}"
        if not isinstance(value, (list, tuple)):
            return Violation(key, value, allowed, why)
        bad = [b for b in value if not _is_int(b) or b < 0 or (last is not None and b > last)]
        if bad or len(set(value)) != len(value):
            return Violation(key, value, allowed, why)
        return None


def violations(rules: Mapping[str, Constraint], params: Mapping[str, Any],
               facts: RunFacts | None) -> list[Violation]:
    """Every param that breaks its rule, in the rules' order (params without a rule are not checked here)."""
    out = []
    for key, rule in rules.items():
        if key in params:
            v = rule.violation(key, params[key], facts)
            if v is not None:
                out.append(v)
    return out

