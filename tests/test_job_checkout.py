"""A workflow script's job runs the fedcore of its own checkout (the code its code inputs fingerprint), even where
another fedcore comes first on the path: a non-editable install, a compat-mode editable install of another clone,
PYTHONPATH. Snakemake appends the workflow's directory to a script job's path, after those."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "workflow" / "scripts"


def _job_imports(helper: str, tmp_path: Path, pre: str = "") -> subprocess.CompletedProcess:
    """A stand-in for a script job: another fedcore (a copy) first on PYTHONPATH, the script's helper imported as the
    scripts do it, then the fedcore file in use printed."""
    other = tmp_path / "other"
    shutil.copytree(ROOT / "fedcore", other / "fedcore", ignore=shutil.ignore_patterns("__pycache__"))
    code = (f"{pre}import sys; sys.path.insert(0, {str(SCRIPTS)!r}); import {helper}; import fedcore; "
            "print(fedcore.__file__)")
    env = {**os.environ, "PYTHONPATH": str(other)}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_job_runs_its_own_checkouts_fedcore_before_another_on_the_path(tmp_path):
    for helper in ("_log", "_gpu"):  # each script imports one of them before any fedcore module
        out = _job_imports(helper, tmp_path / helper)
        assert out.returncode == 0, out.stderr[-2000:]
        assert Path(out.stdout.strip()).resolve() == (ROOT / "fedcore" / "__init__.py").resolve(), helper


def test_a_job_that_imported_another_fedcore_already_stops_with_both_paths(tmp_path):
    out = _job_imports("_log", tmp_path, pre="import fedcore; ")
    assert out.returncode != 0
    assert f"this job must run {ROOT / 'fedcore'}" in out.stderr and str(tmp_path / "other") in out.stderr
