"""A job's own CPU and wall time, written beside its log when the job's Python process exits.

Every workflow script routes its logging through ``workflow/scripts/_log.py``, which calls ``record_at_exit``: at
exit the process writes ``<log stem>.time.json`` with its CPU time (``getrusage``: user + system of the process
and of any children it waited for, every thread included) and its wall time since the process started. The
numbers are the job's own, not samples (Snakemake's ``benchmark:`` samples CPU every 30 s after the first 15 s,
and its wall time counts the waits for a core when jobs outnumber cores). The file is written atomically; no job
reads it as an input, so recording it changes no result and reruns nothing (the report's summary sums it).
"""
from __future__ import annotations

import atexit
import json
import os
import resource
import socket
import time
from pathlib import Path

from fedcore.io import atomic_write_text

SUFFIX = ".time.json"


def time_path(log: str | os.PathLike) -> Path:
    """Where a job with log file ``log`` records its time: beside the log, ``<stem>.time.json``."""
    log = Path(log)
    return log.with_name(log.stem + SUFFIX)


def _process_start() -> float:
    """This process's start (epoch seconds), from /proc where there is one, else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def job_time(start: float) -> dict[str, float | str]:
    """This process's CPU and wall time so far (seconds) and its peak memory (MiB)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = own.ru_utime + kids.ru_utime, own.ru_stime + kids.ru_stime
    return {"cpu_s": round(user + system, 3), "user_s": round(user, 3), "sys_s": round(system, 3),
            "wall_s": round(time.time() - start, 3), "max_rss_mib": round(max(own.ru_maxrss, kids.ru_maxrss) / 1024, 1),
            "host": socket.gethostname()}


def record_at_exit(log: str | os.PathLike) -> None:
    """Write this process's time beside ``log`` when it exits (also after an error: the summary reads only the
    times of runs whose metrics exist)."""
    start, path = _process_start(), time_path(log)
    atexit.register(lambda: atomic_write_text(path, json.dumps(job_time(start), indent=1) + "\n"))


def read_job_time(path: str | os.PathLike) -> dict | None:
    """A recorded time, or None when the job recorded none (it ran before times were recorded)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not a job time record ({e}); delete it, the job's next run writes it again") from e
