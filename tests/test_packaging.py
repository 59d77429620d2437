"""constraints.txt locks the environment CI tests: every package the project needs, and nothing else."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# Not locked (scripts/update_constraints.sh): installer tooling, and torch's CUDA runtime wheels, which the torch
# pin fixes itself and which a CPU or another CUDA build of torch does not take.
UNLOCKED_PREFIXES = ("nvidia-", "cuda-")
UNLOCKED = {"pip", "setuptools", "wheel", "triton"}


def _pins(text: str) -> dict[str, str]:
    """{canonical name: version} of the ``name==version`` lines of a constraints file."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _locked(name: str) -> bool:
    return name not in UNLOCKED and not name.startswith(UNLOCKED_PREFIXES)


def _needed(root: str = "fedcore", extras: frozenset[str] = frozenset({"test"})) -> set[str]:
    """Canonical names of every installed distribution ``root[extras]`` requires, transitively, on this Python."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonicalize_name(root), extras)]
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        for line in metadata.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return {name for name, _ in seen} - {canonicalize_name(root)}


def test_constraints_pin_exactly_the_packages_the_project_needs():
    """(A pin outside pyproject's ranges needs no test: pip refuses to install such a lock.)"""
    pins = _pins((ROOT / "constraints.txt").read_text())
    try:
        metadata.distribution("fedcore")
    except metadata.PackageNotFoundError:
        pytest.skip("fedcore is not installed (pip install -e .): no requirements to walk")
    # what a package requires can change between its versions: walk the locked environment only (CI's, README's)
    other = sorted(f"{n} {v} (lock: {pins[n]})" for n in pins if (v := _installed(n)) not in (None, pins[n]))
    if other:
        pytest.skip(f"this environment was not installed with -c constraints.txt: {', '.join(other[:3])}, ...")
    needed = {name for name in _needed() if _locked(name)}
    assert needed - set(pins) == set(), "needed but not pinned: run scripts/update_constraints.sh"
    assert set(pins) - needed == set(), "pinned but needed by nothing: run scripts/update_constraints.sh"
    assert not [name for name in pins if not _locked(name)], "tooling or torch's CUDA wheels pinned"


def test_the_pin_parser_refuses_a_range():
    assert _pins("# lock\ntorch==2.14.1  # CI\nNumPy==2.4.6\n") == {"torch": "2.14.1", "numpy": "2.4.6"}
    with pytest.raises(AssertionError, match="not an exact pin"):
        _pins("pandas>=3\n")
