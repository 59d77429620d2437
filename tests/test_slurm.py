"""The micro pipeline run for real on a SLURM cluster through profiles/slurm (opt-in: it takes minutes).

Skipped unless ``FEDPROMPT_SLURM=1`` and ``sinfo`` answers. On this machine: ``sudo scripts/slurm_localhost.sh``
starts a one-node cluster whose partitions carry the profile's names, then
``FEDPROMPT_SLURM=1 python -m pytest -p no:xdist -s -m slurm tests/test_slurm.py``. On another cluster, set
``FEDPROMPT_SLURM_CPU_PARTITION`` / ``FEDPROMPT_SLURM_GPU_PARTITION`` to its partition names (written into the
copy's profile, not the repository's) and ``FEDPROMPT_SLURM_WORKDIR`` to a directory on the shared file system.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import yaml

from test_workflow import MICRO_METHODS, MICRO_VARIANT, _planned_jobs, micro_copy


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(os.environ.get("FEDPROMPT_SLURM") != "1" or not _slurm_up(),
                       reason="opt-in: FEDPROMPT_SLURM=1 and a reachable SLURM cluster "
                              "(sudo scripts/slurm_localhost.sh starts one on this machine)"),
]

PARTITION_ENV = {"FEDPROMPT_SLURM_CPU_PARTITION": "cpu", "FEDPROMPT_SLURM_GPU_PARTITION": "gpu"}


def _override_partitions(profile: Path) -> None:
    """Replace the profile's placeholder partition names by the ones given in the environment."""
    names = {default: os.environ[var] for var, default in PARTITION_ENV.items() if os.environ.get(var)}
    if not names:
        return
    doc = yaml.safe_load(profile.read_text())
    for section in [doc.get("default-resources", {}), *doc.get("set-resources", {}).values()]:
        if section.get("slurm_partition") in names:
            section["slurm_partition"] = names[section["slurm_partition"]]
    profile.write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory):
    """The micro workflow run once through ``--workflow-profile profiles/slurm``: (workdir, output, seconds)."""
    base = os.environ.get("FEDPROMPT_SLURM_WORKDIR")
    work = micro_copy(Path(tempfile.mkdtemp(prefix="fedprompt_slurm_", dir=base)) if base
                      else tmp_path_factory.mktemp("slurm"))
    _override_partitions(work / "profiles" / "slurm" / "config.yaml")
    planned = _planned_jobs(work)
    env = {**os.environ, "PYTHONPATH": str(work), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "snakemake", "--workflow-profile", "profiles/slurm"], cwd=work,
                         env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-6000:]
    return work, planned, run.stdout + run.stderr, seconds


def test_every_cluster_job_was_submitted_and_completed_in_sacct(slurm_run):
    work, planned, out, seconds = slurm_run
    remote = re.findall(r"^rule (\w+):", out, flags=re.M)
    local = re.findall(r"^localrule (\w+):", out, flags=re.M)
    # every planned job ran, the non-local ones as SLURM jobs
    assert Counter(remote) + Counter(local) == Counter(r for r, _ in planned)
    assert {"build_dataset", "train", "table", "figure"} <= set(remote)
    ids = re.findall(r"has been submitted with SLURM jobid (\d+)", out)
    assert len(ids) == len(remote)
    acct = subprocess.run(["sacct", "-X", "-n", "-P", "--format=JobIdRaw,State,Partition", "-j", ",".join(ids)],
                          capture_output=True, text=True, check=True).stdout
    states = {line.split("|")[0]: line.split("|")[1] for line in acct.splitlines() if line}
    assert states == {i: "COMPLETED" for i in ids}
    print(f"\nSLURM micro run: {len(ids)} jobs submitted, all COMPLETED in sacct, "
          f"{len(local)} local; wall {seconds:.0f} s ({work})")


def test_outputs_are_complete(slurm_run):
    work = slurm_run[0]
    metrics = pd.read_parquet(work / "results" / "metrics.parquet")
    assert set(metrics["method"]) == set(MICRO_METHODS) | {MICRO_VARIANT}
    assert (work / "results" / "tables" / "sgpt_table1.md").stat().st_size > 0
    assert (work / "results" / "figures" / "sgpt_accuracy_per_round.png").stat().st_size > 1000
    # the profile keeps the SLURM log of every job, successful ones included
    assert list((work / "results" / "logs" / "slurm" / "rule_train").glob("*/*.log"))
    assert _planned_jobs(work) == []
