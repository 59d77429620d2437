"""Dry runs of the micro workflow that need no finished run: paper scale, the SLURM profile, a bad config.

Kept apart from test_workflow.py so a second pytest worker can take them while the micro run builds.
"""
from __future__ import annotations

import pytest
import yaml

from test_workflow import MICRO_METHODS, ROOT, _job_blocks, _snakemake, micro_copy


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    """The micro workflow, copied and configured but not run."""
    return micro_copy(tmp_path_factory.mktemp("wf_dag"))


def test_paper_scale_dag_builds_without_data_and_slurm_gives_each_training_job_one_gpu(micro_dir):
    """Paper scale plans without any data or weights present (fetch, build and weight rules instead of pretraining);
    under the SLURM profile, the same DAG, every training job asks for one GPU, a runtime and memory."""
    out = _snakemake(micro_dir, "-n", "--config", "scale=paper", "--workflow-profile", "profiles/slurm")
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = _job_blocks(out.stdout)
    assert len([b for r, b in jobs if r == "train"]) == 5 * len(MICRO_METHODS) + 1
    rules = {r for r, _ in jobs}
    assert {"fetch_dataset", "build_dataset", "backbone_weights"} <= rules and "pretrain_backbone" not in rules
    assert all("gpu=1" in b and "runtime=" in b and "mem_mb=" in b for r, b in jobs if r == "train")


def test_bad_config_fails_before_any_job(micro_dir):
    out = _snakemake(micro_dir, "-n", "--config", "scale=huge")
    assert out.returncode != 0
    assert "at scale: 'huge' is not one of ['mini', 'paper', 'smoke']" in out.stdout + out.stderr


def test_both_profiles_leave_script_reruns_to_fingerprints():
    """Snakemake's `code` trigger reruns a script's jobs when the script's time changes (a comment, a checkout): both
    profiles turn it off and keep the others; the scripts' fingerprints (rules/common.smk `code`) rerun on code."""
    for name in ("default", "slurm"):
        triggers = yaml.safe_load((ROOT / "profiles" / name / "config.yaml").read_text())["rerun-triggers"]
        assert triggers == ["mtime", "params", "input", "software-env"], name
