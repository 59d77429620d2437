"""The GPU slot pool (fedcore/runtime/gpu_slots.py) with a pretend pool of devices: no GPU needed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedcore.runtime import gpu_slots
from fedcore.runtime.gpu_slots import GpuSlotsBusy, acquire, claim_for_job, lock_dir, pool_devices

ROOT = Path(__file__).resolve().parents[1]
# a job process: claims a GPU of the pretend pool, prints it, holds it until its stdin closes (or it is killed)
HOLDER = ("import sys; from fedcore.runtime.gpu_slots import claim_for_job; "
          "print(claim_for_job(1, 'auto', wait_s=float(sys.argv[1])), flush=True); sys.stdin.read()")


def holder(env: dict[str, str], wait_s: float = 30.0) -> subprocess.Popen:
    """A process that claims a slot as a training job would."""
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(wait_s)], env=env, cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def pool_env(tmp_path):
    """A pretend machine of 3 GPUs (ids as CUDA_VISIBLE_DEVICES could list them) with its own lock directory."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "2,5,7",
            "FEDCORE_GPU_SLOTS_DIR": str(tmp_path / "slots")}


def test_contending_jobs_get_distinct_gpus_and_a_freed_one_is_taken_again(pool_env):
    jobs = [holder(pool_env) for _ in range(3)]
    try:
        got = [j.stdout.readline().strip() for j in jobs]
        assert sorted(got) == ["2", "5", "7"]       # each its own device, the pool's ids
        late = holder(pool_env, wait_s=0)          # a fourth job with nothing free errors at once, clearly
        _, err = late.communicate(timeout=60)
        assert late.returncode != 0 and "all 3 GPUs of this machine's pool are held" in err
        assert all(f"(pid {j.pid})" in err for j in jobs)
        jobs[1].send_signal(signal.SIGKILL)        # a crashed holder's slot frees with its process
        jobs[1].wait(timeout=30)
        again = holder(pool_env, wait_s=30)
        assert again.stdout.readline().strip() == got[1]
        jobs[1] = again
    finally:
        for j in jobs:
            j.kill()
            j.wait(timeout=30)


def test_a_job_waits_for_a_slot_that_frees(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_slots, "POLL_S", 0.05)
    held = acquire(["0"], tmp_path)
    t0 = time.monotonic()   # before the timer starts: a stall between the two lines cannot shorten the measured wait
    threading.Timer(0.5, held.release).start()
    slot = acquire(["0"], tmp_path, wait_s=30)       # locks conflict between open files, threads of one process too
    assert slot.device == "0" and time.monotonic() - t0 >= 0.4
    slot.release()
    with pytest.raises(GpuSlotsBusy, match="gave up after 0 s"):
        blocker = acquire(["0"], tmp_path)
        try:
            acquire(["0"], tmp_path, wait_s=0)
        finally:
            blocker.release()


def test_threads_contending_get_distinct_slots(tmp_path):
    got, lock = [], threading.Lock()

    def take() -> None:
        s = acquire(["0", "1", "2", "3"], tmp_path, wait_s=0)
        with lock:
            got.append(s)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s.device for s in got) == ["0", "1", "2", "3"]
    for s in got:
        s.release()


def test_the_pool_respects_cuda_visible_devices_and_changes_nothing_with_one_device(tmp_path):
    assert pool_devices({"CUDA_VISIBLE_DEVICES": "1,GPU-8f3c,3"}) == ["1", "GPU-8f3c", "3"]
    assert pool_devices({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]     # CUDA stops at an invalid entry
    assert pool_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    env = {"CUDA_VISIBLE_DEVICES": "3", "FEDCORE_GPU_SLOTS_DIR": str(tmp_path)}   # SLURM: one GPU per job
    assert claim_for_job(1, "auto", env) is None and env["CUDA_VISIBLE_DEVICES"] == "3"
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "FEDCORE_GPU_SLOTS_DIR": str(tmp_path)}
    assert claim_for_job(0, "auto", env) is None        # a job without a GPU resource (mini scale)
    assert claim_for_job(1, "cpu", env) is None
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="gpu=2"):
        claim_for_job(2, "auto", env)
    assert lock_dir({"FEDCORE_GPU_SLOTS_DIR": "/x/y"}) == Path("/x/y")
    assert lock_dir({}).name == f"fedcore-gpu-slots-{os.getuid()}"
