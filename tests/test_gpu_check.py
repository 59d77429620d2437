"""The GPU check's plumbing on the CPU (fedcore/gpu_check.py, scripts/gpu_check.sh): its plan fits the budget, its
commands stay valid, a failing or hanging step is recorded and the next runs, and the summary says what ran."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedcore import gpu_check
from fedcore.gpu_check import PLAN_BUDGET_S, SMOKE_SAMPLE, Step, check, plan, plan_wall_s, run_phase, write_summary

ROOT = Path(__file__).resolve().parents[1]


def test_the_plan_fits_ten_minutes_and_each_command_is_valid(tmp_path):
    steps = plan(tmp_path, 16)
    assert plan_wall_s(steps) <= PLAN_BUDGET_S
    assert {s.name for s in steps} >= {"gpu_tests", "default_pipeline", "smoke", "bench_onepass", "bench_fedhpl_vit",
                                       "bench_fedotp", "bench_fedpft"}
    default = next(s for s in steps if s.name == "default_pipeline")
    assert default.config["device"] == "cuda" and default.results == str(tmp_path / "results_default")
    smoke = next(s for s in steps if s.name == "smoke")
    assert f"outputs=[{','.join(SMOKE_SAMPLE)}]" in smoke.argv and "scale=smoke" in smoke.argv
    assert "outputs=all" in next(s for s in plan(tmp_path, 16, "all") if s.name == "smoke").argv
    for s in steps:
        if s.kind != "snakemake":          # the pipelines' --config: loaded in test_dry_mode_checks_and_summarises
            ok, why = check(s)
            assert ok, (s.name, why)
    bad = Step("b", 1, ["python", "benchmarks/bench_train.py", "--no-such-flag"], 1, "benchmark", "")
    assert check(bad) == (False, "benchmarks/bench_train.py declares no ['--no-such-flag']")


def test_failing_and_hanging_steps_are_recorded_and_the_others_run(tmp_path):
    py = sys.executable
    steps = [Step("ok", 2, [py, "-c", "print('1,234.5 images/s')"], 30, "benchmark", "prints"),
             Step("bad", 2, [py, "-c", "raise SystemExit('broken: no CUDA')"], 30, "benchmark", "fails"),
             Step("hang", 2, [py, "-c", "import time; time.sleep(60)"], 1, "benchmark", "hangs")]
    (tmp_path / "logs").mkdir()
    ticks = []   # while steps run, the summary can be rewritten with them as 'running'
    res = {r.name: r for r in run_phase(steps, tmp_path / "logs", lambda p: ticks.append(p), tick_s=0.2)}
    assert ticks and all(len(t) == 3 for t in ticks) and any(r.status == "running" for t in ticks for r in t)
    assert res["ok"].status == "pass" and res["ok"].output == ["1,234.5 images/s"]
    assert res["bad"].status == "fail" and res["bad"].rc == 1 and "broken: no CUDA" in res["bad"].detail
    assert res["bad"].log_tail == ["broken: no CUDA"] and not res["ok"].log_tail
    assert res["hang"].status == "timeout" and res["hang"].wall_s < 30
    env = {k: "?" for k in ("date", "host", "gpu", "driver", "torch", "cuda", "python", "cpus", "commit")}
    md = write_summary(tmp_path, "full", env, list(res.values()), 570, also=tmp_path / "kept").read_text()
    assert "FAILURES" in md and "| hang | 2 | timeout |" in md and "1,234.5 images/s" in md
    assert "## bad: fail, the end of its log" in md and (tmp_path / "kept" / "summary.md").read_text() == md
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert [s["status"] for s in doc["steps"]] == ["pass", "fail", "timeout"]


def test_dry_mode_checks_and_summarises(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "_env_info", lambda python: {
        "date": "d", "host": "h", "gpu": "-", "cuda_available": "False", "driver": "", "torch": "t", "cuda": "c",
        "python": "p", "cpus": "2", "commit": "x"})
    rc = gpu_check.main(["--dry", "--out", str(tmp_path), "--only", "bench_fedpft,gpu_tests,default_pipeline"])
    md = (tmp_path / "summary.md").read_text()
    assert rc == 0 and "Nothing ran on a GPU (dry)" in md
    assert "| default_pipeline | 2 | dry-ok |" in md and "--config loads (55 training runs)" in md


@pytest.mark.skipif(sys.platform != "linux", reason="bash wrapper")
def test_the_bash_wrapper_runs_without_cuda_and_says_so(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}   # no CUDA even where there is some
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--only", "gpu_tests", "--out", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "summary.md").read_text()
    assert "Nothing ran on a GPU (no CUDA)" in md and "| gpu_tests | 2 | dry-ok |" in md


def test_the_official_sgpt_step_comes_only_with_a_checkout(tmp_path):
    """--sgpt-official adds SGPT's round beside the official model's (phase 1); without it the plan has no such step."""
    assert "bench_sgpt_official" not in {s.name for s in plan(tmp_path, 16)}
    steps = plan(tmp_path, 16, sgpt_official=tmp_path / "SGPT")
    step = next(s for s in steps if s.name == "bench_sgpt_official")
    assert step.phase == 1 and str(tmp_path / "SGPT") in step.argv and check(step)[0]
