"""The GPU check's plumbing on the CPU (fedcore/gpu_check.py, scripts/gpu_check.sh): its plan fits the budget, its
commands stay valid, a failing or hanging step is recorded and the next runs, and the summary says what ran."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedcore import gpu_check
from fedcore.gpu_check import (GPU_TESTS_STRICT, PLAN_BUDGET_S, SETUP_S, SMOKE_SAMPLE, Step, cap_to_deadline, check, plan,
                                plan_wall_s, run_phase, strict_refusal_in, without_strict_mode, write_summary)

ROOT = Path(__file__).resolve().parents[1]


def test_the_plan_fits_ten_minutes_and_each_command_is_valid(tmp_path):
    steps = plan(tmp_path, 16)
    # the benchmarks and the preflight at their timeouts leave the side-by-side phase most of its time
    side_by_side = max(s.timeout_s for s in steps if s.phase == 3)
    assert PLAN_BUDGET_S - (plan_wall_s(steps) - side_by_side) >= 290
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


def test_a_step_starting_late_gets_only_what_is_left_of_the_budget(tmp_path):
    """--budget is a wall deadline (a lent GPU's limit on one command): a step about to start keeps its timeout when
    that fits, else gets what is left, and its description says so (as the summary will)."""
    steps = plan(tmp_path, 16, sgpt_official=tmp_path / "SGPT")
    late = [s for s in steps if s.phase == 3]
    before = {s.name: s.timeout_s for s in late}
    assert cap_to_deadline(late, 400, PLAN_BUDGET_S) == []                          # time enough: unchanged
    cuts = cap_to_deadline(late, PLAN_BUDGET_S - SETUP_S - 300, PLAN_BUDGET_S)      # 270 s left
    assert {name for name, _, _ in cuts} == {"gpu_tests", "default_pipeline", "smoke"}
    assert all(s.timeout_s == 270 and "cut from" in s.what for s in late)
    assert all(old == before[name] for name, old, _ in cuts)
    assert cap_to_deadline(late[:1], -5, PLAN_BUDGET_S)[0][2] == 10                 # past the deadline: a floor


def test_a_strict_mode_refusal_in_the_preflight_turns_the_pipelines_deterministic_off(tmp_path):
    """On a torch whose strict mode refuses a call the training paths make, every training job would stop at it:
    the preflight finds it in seconds, and the pipelines then run with deterministic=false, which their --config
    says and which still loads."""
    log = tmp_path / "strict_preflight.log"
    log.write_text("E   RuntimeError: cumsum_cuda_kernel does not have a deterministic implementation, but you set "
                   "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation")
    assert strict_refusal_in(log) == "cumsum_cuda_kernel"
    (tmp_path / "ok.log").write_text("5 passed in 12.0s")
    assert strict_refusal_in(tmp_path / "ok.log") is None and strict_refusal_in(tmp_path / "none.log") is None
    steps = plan(tmp_path, 16)
    later = [s for s in steps if s.phase == 3]
    without_strict_mode(later, "cumsum_cuda_kernel")
    for s in later:
        if s.kind == "snakemake":
            assert "deterministic=False" in s.argv and s.argv.count("--config") == 1
            assert "strict mode refused cumsum_cuda_kernel" in s.what
            ok, why = check(s)
            assert ok and "training runs" in why, why
        else:   # the GPU tests: without strict mode but in the tests of strict mode itself (tests/test_gpu.py)
            assert "deterministic" not in " ".join(s.argv) and s.env == {GPU_TESTS_STRICT: "0"}
    gpu_tests = (ROOT / "tests" / "test_gpu.py").read_text()
    assert f'"{GPU_TESTS_STRICT}"' in gpu_tests
    marked = re.findall(r"@pytest\.mark\.strict\n@pytest\.mark\.parametrize\([^)]*\)\ndef (test_\w+)", gpu_tests)
    assert marked == ["test_strict_mode_lets_each_training_path_run_on_cuda",
                      "test_the_same_config_and_seed_give_the_same_numbers_on_cuda"]
    assert gpu_check.PREFLIGHT_TESTS in marked[0]


def test_a_full_check_hands_the_preflights_refusal_to_the_pipelines(tmp_path, monkeypatch):
    """main() as on a GPU, with stand-in steps: the preflight fails with torch's refusal, so the side-by-side phase's
    pipeline starts with deterministic=False, and the summary says why."""
    py = sys.executable
    refusal = "RuntimeError: cumsum_cuda_kernel does not have a deterministic implementation, but you set it"
    steps = [Step("strict_preflight", 2, [py, "-c", f"raise SystemExit({refusal!r})"], 30, "pytest", "preflight"),
             Step("gpu_tests", 3, [py, "-c", f"import os; print(os.environ.get({GPU_TESTS_STRICT!r}))"], 30,
                  "pytest", "tests"),
             Step("default_pipeline", 3, [py, "-c", "import sys; print(' '.join(sys.argv[1:]))", "--config",
                                          "device=cuda"], 30, "snakemake", "pipeline", {"device": "cuda"},
                  str(tmp_path / "results_default"))]
    monkeypatch.setattr(gpu_check, "plan", lambda *a, **k: steps)
    monkeypatch.setattr(gpu_check, "_env_info", lambda python: {
        "date": "d", "host": "h", "gpu": "H100", "cuda_available": "True", "driver": "", "torch": "t", "cuda": "c",
        "python": "p", "cpus": "16", "commit": "x"})
    assert gpu_check.main(["--out", str(tmp_path)]) == 1                       # the preflight failed, and says so
    assert (tmp_path / "logs" / "default_pipeline.log").read_text().split() == ["--config", "device=cuda",
                                                                               "deterministic=False"]
    assert (tmp_path / "logs" / "gpu_tests.log").read_text().split() == ["0"]
    md = (tmp_path / "summary.md").read_text()
    assert "| strict_preflight | 2 | fail |" in md and "| default_pipeline | 3 | pass |" in md
    assert "deterministic=false: strict mode refused cumsum_cuda_kernel in the preflight" in md


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
    rc = gpu_check.main(["--dry", "--out", str(tmp_path), "--only", "bench_fedpft,strict_preflight,gpu_tests,default_pipeline"])
    md = (tmp_path / "summary.md").read_text()
    assert rc == 0 and "Nothing ran on a GPU (dry)" in md
    assert "| default_pipeline | 3 | dry-ok |" in md and "--config loads (55 training runs)" in md
    assert "| strict_preflight | 2 | dry-ok | 0 | 60 | test file present, test_strict_mode_lets_each_training_path_run" in md


@pytest.mark.skipif(sys.platform != "linux", reason="bash wrapper")
def test_the_bash_wrapper_runs_without_cuda_and_says_so(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}   # no CUDA even where there is some
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--only", "gpu_tests", "--out", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "summary.md").read_text()
    assert "Nothing ran on a GPU (no CUDA)" in md and "| gpu_tests | 3 | dry-ok |" in md


def test_the_official_sgpt_step_comes_only_with_a_checkout(tmp_path):
    """--sgpt-official adds SGPT's round beside the official model's (phase 1); without it the plan has no such step."""
    assert "bench_sgpt_official" not in {s.name for s in plan(tmp_path, 16)}
    steps = plan(tmp_path, 16, sgpt_official=tmp_path / "SGPT")
    step = next(s for s in steps if s.name == "bench_sgpt_official")
    assert step.phase == 1 and str(tmp_path / "SGPT") in step.argv and check(step)[0]


# what the benchmarks print on a GPU (their own format strings; figures made up), as the check's logs hold them
ONEPASS_LOG = """# preset paper, 4 steps a client, NVIDIA H100, torch 2.14.1, amp=True, compile=None, deterministic=True
# family       C   B GFLOP/img | images/s: one by one  one pass      vmap | pass/1x1  pass/vmap | share of peak
  fedvpt       5  64    70.000 |               3400.0    6100.0         - |     1.79x         - | 24.1%, 43.2%
  sgpt         5  40    71.000 |               3300.0    5000.0         - |     1.52x         - | 23.7%, 35.9%
  fedhpl       5  16    70.000 |                800.0    3200.0         - |     4.00x         - | 5.7%, 22.6%
  fedotp      10  32    40.000 |               1000.0    2500.0         - |     2.50x         - | 4.0%, 10.1%
"""
OFFICIAL_LOG = """# SGPT round: 5 clients x 3 steps x batch 40, two blocks, preset paper, NVIDIA H100
  official, fp32 (as shipped)         489.0 images/s    1.00x the official as shipped
  ours, one by one                   3300.0 images/s    6.75x the official as shipped
  ours, one pass                     5000.0 images/s   10.22x the official as shipped
"""
HPL_LOG = """# FedHPL hetvit, batch 16, 20 steps, NVIDIA H100, amp=True
vit_small_patch16_224     train     678.0 images/s   upload/eval    2000.0 images/s
estimated round (5 clients x 10000 train images, upload pass, 2000 test images each, one after another): 146 s
"""


def test_the_benchmarks_figures_reach_the_summary_and_its_targets(tmp_path):
    """bench_onepass.py's and bench_sgpt_official.py's rows are indented: the summary kept only their header lines
    (indented lines were dropped as traceback frames). Issue 24's targets are read from the figures kept."""
    from fedcore.gpu_check import _outcome

    logs = {}
    for name, text in (("bench_onepass", ONEPASS_LOG), ("bench_sgpt_official", OFFICIAL_LOG),
                       ("bench_fedhpl_vit", HPL_LOG)):
        logs[name] = tmp_path / f"{name}.log"
        logs[name].write_text(text)
    outputs = {n: _outcome(Step(n, 1, ["x"], 1, "benchmark", ""), p)[1] for n, p in logs.items()}
    assert "  fedvpt       5  64    70.000 |               3400.0    6100.0         - |     1.79x         - | " \
           "24.1%, 43.2%" in outputs["bench_onepass"]
    env = {k: "?" for k in ("date", "host", "gpu", "driver", "torch", "cuda", "python", "cpus", "commit")}
    res = [gpu_check.Result(n, 1, "pass", "", "", 1, output=o) for n, o in outputs.items()]
    md = write_summary(tmp_path, "full", env, res, 570).read_text()
    assert "| fedvpt: share of the bf16 peak, one pass | >= 40 % | 43.2 % | met |" in md
    assert "| sgpt: share of the bf16 peak, one pass | >= 40 % | 35.9 % | NOT met |" in md
    assert "| sgpt: ours in one pass over the official code's round | >= 10x | 10.2x | met |" in md
    assert "| fedhpl: a paper round (hetvit), estimated | <= 40 s | 36.5 s | met |" in md   # 146 s / 4.00
    assert "| fedotp: one pass over one by one | >= 3x | 2.5x | NOT met |" in md


def test_a_target_whose_benchmark_did_not_run_says_not_measured():
    from fedcore.gpu_targets import evaluate

    targets = evaluate({"bench_onepass": ONEPASS_LOG.splitlines()})
    by = {t.name.split(":")[0] + ("" if "peak" not in t.name else " peak"): t for t in targets}
    assert by["sgpt"].met is None and by["sgpt"].measured is None   # no --sgpt-official
    assert by["fedhpl"].met is None                                  # no bench_fedhpl_vit figure
    cpu = "  fedvpt       5  40     0.015 |               2104.5    2314.2    1957.9 |     1.10x     1.18x | "
    assert evaluate({"bench_onepass": [cpu]})[0].met is None          # no share of a peak on the CPU
