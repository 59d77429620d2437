"""Values kept between processes in a JSON file, so that a later `snakemake` call (a dry run, each SLURM job) reuses
what an earlier one computed while building the DAG (rules/common.smk names the files, under results/cache/).

Each value must be a pure function of its key and of the memo's version (the code that computes it): a file of
another version is not read, and an unreadable one is ignored and written afresh. Deleting the file costs one
slower call and reruns nothing.
"""
from __future__ import annotations

import atexit
import json
from pathlib import Path
from typing import Any, Callable

from fedcore.io import atomic_path


class MemoFile:
    """A memo of JSON values by string key, read from one file and saved back at exit when this process computed a
    value; saving keeps only the keys this process asked for (an edited source's old entry is dropped)."""

    def __init__(self, version: Callable[[], str]) -> None:
        self._version = version  # called when the file is read or written: it may read files itself
        self.values: dict[str, Any] = {}
        self.used: set[str] = set()
        self.file: Path | None = None
        self.dirty = False

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        """The value of ``key``: kept, or computed now (once per process)."""
        self.used.add(key)
        if key not in self.values:
            self.values[key] = compute()
            self.dirty = True
        return self.values[key]

    def keep_in(self, file: str | Path) -> None:
        """Reuse the values saved in ``file`` (of this version) and save this process's there when it exits."""
        file = Path(file)
        try:
            saved = json.loads(file.read_text(encoding="utf-8"))
            if saved["version"] == self._version():
                for key, value in saved["values"].items():
                    self.values.setdefault(key, value)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # computed again, and saved afresh
        if self.file is None:
            atexit.register(self.save)
        self.file = file

    def save(self) -> None:
        """Write the values this process asked for to the file (atomically), if it computed any."""
        if self.file is None or not self.dirty:
            return
        doc = {"version": self._version(), "values": {k: self.values[k] for k in sorted(self.used)}}
        try:
            with atomic_path(self.file) as tmp:
                tmp.write_text(json.dumps(doc), encoding="utf-8")
            self.dirty = False
        except OSError:
            pass  # e.g. a read-only results directory: computed again next time
