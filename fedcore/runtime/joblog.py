"""A job's log that keeps the log of the job's earlier attempts.

Snakemake deletes a job's log before every attempt, so a training run that resumes from its checkpoint
would lose the log of the attempt it resumes from. With a history file outside the job's declared outputs,
every line goes to both files, and a new attempt first copies the history into its fresh log, under a
marker line.
"""
from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path
from typing import TextIO

MARKER = "===== {when}: attempt {n} of this job; the log above is from the earlier attempts ====="
_MARKER_RE = re.compile(r"^===== .*: attempt \d+ of this job; ", re.MULTILINE)


class Tee(io.TextIOBase):
    """A text stream that writes to several line-buffered files (the log and its history)."""

    def __init__(self, *files: TextIO) -> None:
        super().__init__()
        self.files = files

    def write(self, text: str) -> int:
        """Write to every file."""
        for f in self.files:
            f.write(text)
        return len(text)

    def flush(self) -> None:
        """Flush every file."""
        for f in self.files:
            f.flush()

    @property
    def encoding(self) -> str:
        """The job log's encoding (progress bars draw with it)."""
        return self.files[0].encoding

    def isatty(self) -> bool:
        """Never a terminal (progress bars then print plain updates)."""
        return False

    def fileno(self) -> int:
        """The job log's descriptor, for code that writes to stderr's descriptor directly."""
        return self.files[0].fileno()

    def close(self) -> None:
        """Flush and close every file."""
        if not self.closed:
            super().close()  # flushes first
            for f in self.files:
                f.close()


def open_job_log(log: str | os.PathLike, history: str | os.PathLike | None = None) -> TextIO:
    """The job's log, opened to append; with ``history`` also that file, its earlier attempts copied in first."""
    fresh = not os.path.exists(log) or os.path.getsize(log) == 0  # Snakemake deleted it before this attempt
    out = open(log, "a", buffering=1)
    if history is None:
        return out
    history = Path(history)
    history.parent.mkdir(parents=True, exist_ok=True)
    earlier = history.read_text(errors="replace") if history.exists() else ""
    kept = open(history, "a", buffering=1)
    if earlier:
        if fresh:  # put the earlier attempts back
            out.write(earlier)
        attempt = 2 + len(_MARKER_RE.findall(earlier))
        line = MARKER.format(when=time.strftime("%Y-%m-%d %H:%M:%S"), n=attempt)
        lead = "" if earlier.endswith("\n") else "\n"  # an attempt killed mid-line
        for f in (out, kept):
            f.write(f"{lead}{line}\n")
    return Tee(out, kept)
