"""One GPU per job on a machine with several: a pool of lock files, one per visible device.

Snakemake's ``--resources gpu=N`` only counts: it lets N jobs that declare ``gpu=1`` run at once, but every one of
them would open ``cuda`` (device 0). A job that holds a GPU calls :func:`claim_for_job` before CUDA starts: it takes
the first device of the pool whose lock file it can lock (``fcntl.flock``, non-blocking) and narrows
``CUDA_VISIBLE_DEVICES`` to it, so everything in the process that says ``cuda`` lands there. The lock belongs to
the open file, so it is released when the process ends, however it ends (a crash, a kill).

The pool is the devices the process may see: the entries of ``CUDA_VISIBLE_DEVICES`` where it is set (a scheduler
such as SLURM sets it per job), else every GPU the driver lists (``nvidia-smi -L``; counted without initialising
CUDA, which would freeze the process's view of the devices). With one device or none nothing changes: under
SLURM each job gets its own GPU already. The lock files live in a machine-local directory
(``FEDCORE_GPU_SLOTS_DIR``, default ``<tmp>/fedcore-gpu-slots-<uid>``), so two pipelines of one user on one
machine share the pool too.

Self-contained (standard library only) so that it can move into a runtime module with device picking.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping, MutableMapping

__all__ = ["GpuSlotsBusy", "Slot", "pool_devices", "lock_dir", "acquire", "claim_for_job"]

log = logging.getLogger(__name__)

#: seconds between tries while every slot is held, and between the log lines that say so
POLL_S = 2.0
LOG_EVERY_S = 60.0

_held: list["Slot"] = []   # slots this process holds: their files stay open (and locked) until it exits


class GpuSlotsBusy(RuntimeError):
    """Every GPU of the pool stayed held by other processes for longer than the job would wait."""


@dataclass
class Slot:
    """A claimed device: its id as CUDA_VISIBLE_DEVICES names it, and the open, locked file that holds it."""

    device: str
    file: IO[str]

    def release(self) -> None:
        """Unlock and close (the process's end does the same)."""
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def _driver_gpus() -> list[str]:
    """Indices of the GPUs the NVIDIA driver lists, without initialising CUDA ([] without a driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        proc = Path("/proc/driver/nvidia/gpus")
        return [str(i) for i in range(len(list(proc.iterdir())))] if proc.is_dir() else []
    return [str(i) for i, line in enumerate(x for x in out.splitlines() if x.startswith("GPU "))]


def pool_devices(env: Mapping[str, str] | None = None) -> list[str]:
    """The devices this process may use: CUDA_VISIBLE_DEVICES' entries where set, else every driver-listed GPU."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        # CUDA stops reading the list at the first invalid entry ("-1" hides every device)
        out = []
        for d in (x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(",")):
            if not d or d.startswith("-"):
                break
            out.append(d)
        return out
    return _driver_gpus()


def lock_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the pool's lock files live: FEDCORE_GPU_SLOTS_DIR, else a per-user directory under the machine's tmp."""
    env = os.environ if env is None else env
    given = env.get("FEDCORE_GPU_SLOTS_DIR")
    return Path(given) if given else Path(tempfile.gettempdir()) / f"fedcore-gpu-slots-{os.getuid()}"


def _lock_name(device: str) -> str:
    """A file name for a device id (an index, or a UUID such as GPU-8f3c...)."""
    return "gpu-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in device) + ".lock"


def _try_lock(path: Path, device: str) -> Slot | None:
    """The slot of ``device`` if its lock file can be locked now (its holder's pid written into it), else None."""
    f = open(path, "a+")   # noqa: SIM115 - stays open while the slot is held
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return None
        raise
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return Slot(device, f)


def _holders(directory: Path, devices: list[str]) -> str:
    """'device (pid N)' for each device of the pool, as the lock files say (for an error message)."""
    out = []
    for d in devices:
        try:
            pid = (directory / _lock_name(d)).read_text().strip() or "?"
        except OSError:
            pid = "?"
        out.append(f"{d} (pid {pid})")
    return ", ".join(out)


def acquire(devices: list[str], directory: Path, wait_s: float | None = None) -> Slot:
    """The first free device of ``devices`` (its lock taken), waiting while all are held: for ever when ``wait_s``
    is None, else at most ``wait_s`` seconds, then GpuSlotsBusy."""
    if not devices:
        raise ValueError("the GPU pool is empty: no device to claim")
    directory.mkdir(parents=True, exist_ok=True)
    start, last_log = time.monotonic(), None
    while True:
        for d in devices:
            slot = _try_lock(directory / _lock_name(d), d)
            if slot is not None:
                return slot
        now = time.monotonic()
        if wait_s is not None and now - start >= wait_s:
            raise GpuSlotsBusy(
                f"all {len(devices)} GPUs of this machine's pool are held by other jobs: {_holders(directory, devices)} "
                f"(lock files in {directory}); gave up after {wait_s:g} s. Run at most as many GPU jobs at once as "
                f"there are GPUs (`--resources gpu={len(devices)}`), or wait for the other pipeline to finish")
        if last_log is None or now - last_log >= LOG_EVERY_S:
            log.info("waiting for a free GPU: all of %s are held (%s)", devices, _holders(directory, devices))
            last_log = now
        time.sleep(POLL_S)


def claim_for_job(gpus: int, device: str = "auto", env: MutableMapping[str, str] | None = None,
                  wait_s: float | None = None) -> str | None:
    """Give a job that declares ``gpus`` (Snakemake's ``gpu`` resource) one free GPU of the machine's pool: the
    device it took (CUDA_VISIBLE_DEVICES narrowed to it), or None where nothing changes (no GPU declared, device
    cpu, a pool of one device or none). Call it before anything initialises CUDA.

    ``wait_s`` (default: FEDCORE_GPU_WAIT_S, else for ever): how long to wait while every GPU is held."""
    env = os.environ if env is None else env
    if gpus < 1 or device == "cpu":
        return None
    if gpus > 1:
        raise ValueError(f"a job declares gpu={gpus}: the GPU pool gives each job one device")
    devices = pool_devices(env)
    if len(devices) <= 1:
        return None
    if wait_s is None and env.get("FEDCORE_GPU_WAIT_S"):
        wait_s = float(env["FEDCORE_GPU_WAIT_S"])
    slot = acquire(devices, lock_dir(env), wait_s)
    _held.append(slot)
    env["CUDA_VISIBLE_DEVICES"] = slot.device
    log.info("GPU pool %s: this job holds device %s (CUDA_VISIBLE_DEVICES=%s)", devices, slot.device, slot.device)
    return slot.device
