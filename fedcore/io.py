"""Atomic file writes (a crash never leaves a half-written output behind), and reading a pipeline file
back with an error that names it and says how to get a good copy when it is truncated or corrupt."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix or path.suffix, dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; results should be readable like any other file
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save `obj` to `path` atomically, through a file object: torch names the archive inside a .pt
    after the file it is given, which would be the random temporary name and make equal runs' files differ."""
    import torch  # here, not at the top: report jobs import this module and need no torch

    with atomic_path(path, suffix=".pt") as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write text to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


class UnreadableFileError(ValueError):
    """A file that exists but cannot be read back (truncated, corrupt, or not the format its name says)."""


def rebuild_hint(rule: str) -> str:
    """How to recover a broken file that the pipeline writes itself: its rule rebuilds it."""
    return f"delete it and rerun snakemake, which rebuilds it with rule {rule}"


def unreadable(path: str | os.PathLike, err: BaseException, recover: str) -> str:
    """The message for a file that cannot be read: which file, the library's own error, and what to do."""
    return f"{path} is unreadable or incomplete ({type(err).__name__}: {err}): {recover}"


def read_npz(path: str | os.PathLike, rule: str) -> dict[str, np.ndarray]:
    """Every array of an .npz file written by rule ``rule``, or an UnreadableFileError naming the file.

    All arrays are read here, so that a damaged member fails in this one place rather than at first use.
    """
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise  # callers say which rule builds a missing file
    except Exception as err:  # noqa: BLE001 - zip, zlib, numpy header and OS errors alike mean a bad file
        raise UnreadableFileError(unreadable(path, err, rebuild_hint(rule))) from err
