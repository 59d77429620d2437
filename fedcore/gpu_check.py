"""Everything GPU-side in one command (scripts/gpu_check.sh): the GPU tests, the default pipeline on CUDA from an
empty results directory, a sample of the smoke DAG, and the throughput benchmarks at paper shapes, each with a
timeout; one summary (``summary.md`` + ``summary.json``) of pass/fail, wall times and the benchmark figures.

Three phases, so that the whole check fits 10 minutes on one H100 (``PLAN_BUDGET_S``, ``--budget``: a wall deadline;
a step starting late gets only what is left): the benchmarks one after another on a quiet GPU (their figures are
undisturbed); a preflight of strict deterministic mode (one run of each training path, seconds); then the GPU tests,
the default pipeline and the smoke sample side by side (the cores split between the two pipelines; each is mostly
launch-bound on small models). If the preflight shows that this machine's torch refuses a call in strict mode, the
pipelines run with ``deterministic=false`` and the summary says which call, rather than every training job stopping
at it. A step that fails or times out is recorded and the next one runs. Without CUDA, or with ``--dry``, no step
runs: each is checked for plumbing instead (its files exist, every flag a benchmark is given is one it declares, each
pipeline's ``--config`` loads), and the summary says so.

    python -m fedcore.gpu_check --out gpu_check                  # (scripts/gpu_check.sh sets up the packages)
    python -m fedcore.gpu_check --dry --out /tmp/gc              # plumbing only, on any machine
    python -m fedcore.gpu_check --smoke-outputs all              # the whole smoke DAG (longer than 10 minutes)
"""
from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from fedcore.gpu_targets import evaluate, targets_markdown

ROOT = Path(__file__).resolve().parents[1]
#: the smoke sample: one small output per paper that trains its paper-scale backbones (SGPT's ViT-B ablation,
#: FedHPL's heterogeneous ViTs and ResNets, FedOTP's CLIP with a transport-plan probe, FedPFT's ResNet-8/10 with
#: linear probes); 23 runs at paper scale's experiments
SMOKE_SAMPLE = ("sgpt_table3", "fedhpl_fig10", "fedotp_fig_a4", "fedpft_table5")
#: the wall time the plan is sized for on one H100: set-up (scripts/gpu_check.sh) + the phases' timeouts
PLAN_BUDGET_S = 600
SETUP_S = 30
#: tests/test_gpu.py's preflight: one run of each training path in strict deterministic mode
PREFLIGHT_TESTS = "strict_mode_lets_each_training_path_run"
#: torch's words when strict mode refuses a call on CUDA ("<op> does not have a deterministic implementation, ...")
REFUSAL = re.compile(r"(\w+) does not have a deterministic implementation")


@dataclass
class Step:
    """One check: a command run from the repository root with a timeout (seconds)."""

    name: str
    phase: int                       # phases run in order; the steps of a phase side by side
    argv: list[str]
    timeout_s: float
    kind: str                        # pytest | snakemake | benchmark (what its dry check and summary read)
    what: str                        # one line for the summary
    config: dict[str, Any] = field(default_factory=dict)   # a snakemake step's --config
    results: str | None = None       # a snakemake step's results directory (emptied before it runs)
    env: dict[str, str] = field(default_factory=dict)      # set in the step's environment


@dataclass
class Result:
    """What a step did: status pass | fail | timeout | skipped | dry-ok | dry-fail."""

    name: str
    phase: int
    status: str
    what: str
    command: str
    timeout_s: float
    wall_s: float = 0.0
    rc: int | None = None
    log: str | None = None
    detail: str = ""
    output: list[str] = field(default_factory=list)   # a benchmark's printed figures
    log_tail: list[str] = field(default_factory=list)  # a failed or timed-out step's last log lines


def _config_args(config: dict[str, Any]) -> list[str]:
    """``--config k=v ...`` as Snakemake parses it (lists as [a,b])."""
    return ["--config", *(f"{k}=[{','.join(v)}]" if isinstance(v, (list, tuple)) else f"{k}={v}"
                          for k, v in config.items())]


def plan(out: Path, cores: int, smoke_outputs: str | list[str] = SMOKE_SAMPLE, python: str = sys.executable,
         sgpt_official: Path | None = None) -> list[Step]:
    """The steps of a full check writing under ``out`` with ``cores`` CPU cores; with ``sgpt_official`` (a checkout
    of ubc-tea/SGPT) also SGPT's round beside the official model's (40 s more)."""
    py = [python]
    default_cores, smoke_cores = max(1, cores - cores // 3 - 1), max(1, cores // 3)
    default_cfg = {"results": str(out / "results_default"), "device": "cuda"}
    smoke_all = smoke_outputs == "all"
    smoke_cfg = {"results": str(out / "results_smoke"), "scale": "smoke",
                 "outputs": "all" if smoke_all else list(smoke_outputs)}
    bench = "benchmarks/"
    official = [] if sgpt_official is None else [
        Step("bench_sgpt_official", 1, py + [bench + "bench_sgpt_official.py", "--official", str(sgpt_official),
                                             "--preset", "paper", "--amp", "--steps", "3", "--repeats", "2"], 40,
             "benchmark", "SGPT's round (5 clients x batch 40, both blocks, ViT-B/16) with the official model (fp32 as "
             "shipped, bf16) beside ours one by one and in one pass: issue 24's >= 10x target")]
    return official + [
        Step("bench_onepass", 1, py + [bench + "bench_onepass.py", "--preset", "paper", "--amp", "--steps", "4",
                                       "--repeats", "2", "--families", "fedvpt", "sgpt", "fedhpl", "fedotp"], 60,
             "benchmark", "a round's clients one by one vs in one pass (vs vmap where offered) at paper shapes, bf16: "
             "images/s and share of the bf16 peak per family (FedVPT, SGPT, FedHPL, FedOTP)"),
        Step("bench_fedhpl_vit", 1, py + [bench + "bench_fedhpl.py", "--setting", "hetvit", "--amp", "--steps", "20"],
             50, "benchmark", "one FedHPL round, heterogeneous ViT-S/B/L at 224 px, batch 16: images/s, round time"),
        Step("bench_fedhpl_res", 1, py + [bench + "bench_fedhpl.py", "--setting", "hetres", "--amp", "--steps", "20"],
             30, "benchmark", "one FedHPL round, heterogeneous ResNet-18/34/50 + pad prompts, batch 16"),
        Step("bench_fedotp", 1, py + [bench + "bench_fedotp.py", "--arch", "clip_vit_b16", "--classes", "100",
                                      "--steps", "20"], 35, "benchmark",
             "FedOTP step, CLIP ViT-B/16, K = 100, batch 32: cached tokens vs re-encoding, OT share"),
        Step("bench_fedpft", 1, py + [bench + "bench_fedpft.py", "--clients", "40", "--images", "500", "--batch", "100",
                                      "--arch", "resnet8_pft", "--side", "32", "--queue", "65536", "--epochs", "1",
                                      "--feature-epochs", "1", "--rounds", "1", "--only", "fedpft"], 40, "benchmark",
             "FedPFT round at paper shapes (40 ResNet-8 clients x 500 images, K = 65536), 1 of 5 epochs: "
             "one by one vs together"),
        Step("strict_preflight", 2, py + ["-m", "pytest", "tests/test_gpu.py", "-k", PREFLIGHT_TESTS, "-x", "-o",
                                          "addopts=", "-q", "-p", "no:cacheprovider"], 60, "pytest",
             "strict deterministic mode on this machine's torch: one run of each training path (FedVPT, SGPT, FedOTP, "
             "FedBN, FedPFT); a refusal turns the pipelines' deterministic off, said here"),
        Step("gpu_tests", 3, py + ["-m", "pytest", "tests/test_gpu.py", "-o", "addopts=", "-q", "-p",
                                   "no:cacheprovider"], 330, "pytest",
             "tests/test_gpu.py on CUDA (every method and variant, 2 rounds each, and batched = one by one)"),
        Step("default_pipeline", 3, py + ["-m", "snakemake", "--cores", str(default_cores),
                                          *_config_args(default_cfg)], 340, "snakemake",
             f"the default pipeline (mini, headline outputs) on CUDA from an empty results directory, "
             f"{default_cores} cores", default_cfg, default_cfg["results"]),
        Step("smoke", 3, py + ["-m", "snakemake", "--cores", str(smoke_cores), *_config_args(smoke_cfg)],
             1200 if smoke_all else 300, "snakemake",
             f"scale smoke, outputs {'all' if smoke_all else ', '.join(smoke_outputs)} (synthetic data, random "
             f"weights), {smoke_cores} cores", smoke_cfg, smoke_cfg["results"]),
    ]


def plan_wall_s(steps: list[Step]) -> float:
    """The longest the plan can take: set-up, then per phase its longest timeout (phase 1's run one by one)."""
    total = SETUP_S
    for phase in sorted({s.phase for s in steps}):
        times = [s.timeout_s for s in steps if s.phase == phase]
        total += sum(times) if phase == 1 else max(times)
    return total


def cap_to_deadline(steps: list[Step], left_s: float, budget_s: float,
                    floor_s: float = 10.0) -> list[tuple[str, float, float]]:
    """Cut the timeouts of steps about to start to the ``left_s`` seconds left of the ``budget_s`` deadline (a lent
    GPU's limit on one command), each noted in its description; (step, old, new) for each step cut."""
    cuts = []
    for s in steps:
        new = max(floor_s, left_s)
        if s.timeout_s > new:
            cuts.append((s.name, s.timeout_s, new))
            s.what += f" (timeout cut from {s.timeout_s:.0f} s to {new:.0f} s: the {budget_s:.0f} s budget)"
            s.timeout_s = new
    return cuts


#: tests/test_gpu.py reads it: "0" runs its tests without strict mode, but those of strict mode itself
GPU_TESTS_STRICT = "FEDCORE_GPU_TESTS_STRICT"


def without_strict_mode(steps: list[Step], op: str) -> None:
    """The pipelines of ``steps`` run with ``deterministic=false``, and the GPU tests but strict mode's own without
    it, because strict mode refused ``op`` here."""
    for s in steps:
        if s.kind == "snakemake":
            s.config["deterministic"] = False
            at = s.argv.index("--config")
            s.argv[at:] = _config_args(s.config)
            s.what += f" (deterministic=false: strict mode refused {op} in the preflight)"
        elif s.kind == "pytest":
            s.env[GPU_TESTS_STRICT] = "0"
            s.what += f" (without strict mode but in its own tests: it refused {op} in the preflight)"


def strict_refusal_in(log: Path) -> str | None:
    """The call that strict deterministic mode refused in a step's log, if it did."""
    m = REFUSAL.search(log.read_text(errors="replace")) if log.exists() else None
    return m.group(1) if m else None


# ---- plumbing checks (--dry, or no CUDA) ------------------------------------------------------------------------


def declared_flags(script: Path) -> set[str]:
    """The ``--flags`` a script's argparse declares (read from its source: nothing is imported or run)."""
    flags = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def smoke_missing(root: Path = ROOT) -> str | None:
    """Why the smoke scale cannot run in this checkout, or None."""
    return None if (root / "config" / "scales" / "smoke.yaml").exists() else \
        "no smoke scale in this checkout (config/scales/smoke.yaml)"


def check(step: Step, root: Path = ROOT) -> tuple[bool, str]:
    """(ok, what was checked or what is wrong) for a step's command, without running it."""
    if step.kind == "benchmark":
        script = root / step.argv[1]
        if not script.exists():
            return False, f"{step.argv[1]} does not exist"
        unknown = sorted({a for a in step.argv[2:] if a.startswith("--")} - declared_flags(script))
        return (not unknown, f"{step.argv[1]} declares no {unknown}" if unknown
                else f"{step.argv[1]} takes every flag given")
    if step.kind == "pytest":
        files = [a for a in step.argv if a.startswith("tests/")]
        missing = [a for a in files if not (root / a).exists()]
        if missing:
            return False, f"missing {missing}"
        chosen = step.argv[step.argv.index("-k") + 1] if "-k" in step.argv else None
        if chosen and not any(f"def test_{chosen}" in (root / a).read_text() for a in files):
            return False, f"no test in {files} is named test_{chosen}..."
        return True, "test file present" + (f", test_{chosen}... in it" if chosen else "")
    from fedcore.config import ConfigError, load_config, read_yaml

    try:   # as Snakemake gives it: config/config.yaml, then --config
        given = {k: list(v) if isinstance(v, tuple) else v for k, v in step.config.items()}
        cfg = load_config({**read_yaml(root / "config" / "config.yaml"), **given}, root)
    except (ConfigError, ValueError) as e:
        return False, f"--config does not load: {e}"
    return True, f"--config loads ({len(cfg.runs())} training runs)"


# ---- running -----------------------------------------------------------------------------------------------------


def _outcome(step: Step, log: Path) -> tuple[str, list[str]]:
    """A step's one-line detail and its figures, read from its log and outputs."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if step.kind == "pytest":
        last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", ln)]
        return (last[-1].strip("= ") if last else "no pytest summary line"), []
    if step.kind == "snakemake":
        res = Path(step.results or "")
        runs = len(list(res.glob("runs/**/metrics.parquet")))
        tables = len(list(res.glob("tables/*.md")))
        figures = len(list(res.glob("figures/*.png")))
        failed = sorted(set(re.findall(r"Error in rule (\w+):", text)))
        done = re.findall(r"(\d+) of (\d+) steps \((\d+%)\) done", text)
        progress = f"{done[-1][0]} of {done[-1][1]} jobs done" if done else "no job finished"
        return (f"{progress}; {runs} training runs, {tables} tables, {figures} figures"
                + (f"; failed rules: {', '.join(failed)}" if failed else "")), []
    # a benchmark prints its figures (bench_onepass.py's rows are indented); a failing one ends with the
    # exception's line, after the traceback's indented frames, which are left out
    lines, in_traceback = [], False
    for ln in text.splitlines():
        if ln.startswith("Traceback"):
            in_traceback = True
            continue
        if in_traceback and ln.startswith(" "):
            continue
        in_traceback = False
        if ln.strip():
            lines.append(ln)
    return (lines[-1].strip()[:200] if lines else "no output"), lines[-20:]


def _env_info(python: str) -> dict[str, str]:
    """The machine and software the figures come from."""
    def out(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    probe = ("import torch, platform; c = torch.cuda.is_available(); "
             "print(torch.__version__, torch.version.cuda, c, torch.cuda.get_device_name() if c else '-', "
             "platform.python_version(), sep='|')")
    torch_v, cuda_v, avail, gpu, py_v = (out([python, "-c", probe]) or "?|?|False|-|?").split("|")
    return {"date": dt.datetime.now().isoformat(timespec="seconds"), "host": os.uname().nodename,
            "gpu": gpu, "cuda_available": avail, "torch": torch_v, "cuda": cuda_v, "python": py_v,
            "driver": out(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
            "commit": out(["git", "rev-parse", "--short", "HEAD"])
            + (" (uncommitted changes)" if out(["git", "status", "--porcelain", "--untracked-files=no"]) else ""),
            "cpus": str(os.cpu_count())}


def _kill(proc: subprocess.Popen) -> None:
    """Stop a step and everything it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _last_lines(path: Path, n: int = 30) -> list[str]:
    """The last ``n`` lines of a log."""
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def run_phase(steps: list[Step], logs: Path, on_tick: Callable[[list[Result]], None] | None = None,
              tick_s: float = 15.0) -> list[Result]:
    """Run the steps side by side, each to its end or its timeout; every ``tick_s`` seconds ``on_tick`` gets the
    results so far, the steps still running as status 'running' (so that a check killed from outside leaves a
    summary)."""
    running = {}
    for s in steps:
        if s.results:
            shutil.rmtree(s.results, ignore_errors=True)   # from an empty results directory
        log = logs / f"{s.name}.log"
        fh = open(log, "w")   # noqa: SIM115 - closed when the step ends
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **s.env}
        proc = subprocess.Popen(s.argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        running[s.name] = (s, proc, fh, time.monotonic(), log)
    results: dict[str, Result] = {}
    last_tick = time.monotonic()
    while running:
        time.sleep(0.5)
        if on_tick is not None and time.monotonic() - last_tick >= tick_s:
            last_tick = time.monotonic()
            on_tick([results.get(s.name) or Result(s.name, s.phase, "running", s.what, " ".join(s.argv), s.timeout_s,
                                                   round(time.monotonic() - running[s.name][3], 1), log=str(
                                                       logs / f"{s.name}.log")) for s in steps])
        for name, (s, proc, fh, t0, log) in list(running.items()):
            wall = time.monotonic() - t0
            timed_out = proc.poll() is None and wall > s.timeout_s
            if timed_out:
                _kill(proc)
            if proc.poll() is None:
                continue
            fh.close()
            detail, output = _outcome(s, log)
            status = "timeout" if timed_out else "pass" if proc.returncode == 0 else "fail"
            results[name] = Result(s.name, s.phase, status, s.what, " ".join(s.argv), s.timeout_s, round(wall, 1),
                                   proc.returncode, str(log), detail, output,
                                   _last_lines(log) if status != "pass" else [])
            del running[name]
    return [results[s.name] for s in steps]


def write_summary(out: Path, mode: str, env: dict[str, str], results: list[Result], budget_s: float,
                  also: Path | None = None) -> Path:
    """``summary.json`` and ``summary.md`` under ``out`` (and copies under ``also``); returns the Markdown file."""
    doc = {"mode": mode, "env": env, "plan_budget_s": budget_s, "steps": [asdict(r) for r in results]}
    (out / "summary.json").write_text(json.dumps(doc, indent=2))
    ok = all(r.status in ("pass", "dry-ok", "skipped") for r in results)
    state = "running" if any(r.status == "running" for r in results) else "all passed" if ok else "FAILURES"
    lines = [f"# GPU check: {state} ({mode})", "",
             f"{env['date']} on {env['host']}: GPU {env['gpu']} ({env['driver'] or 'no nvidia-smi'}), torch "
             f"{env['torch']} (CUDA {env['cuda']}), Python {env['python']}, {env['cpus']} CPUs, commit {env['commit']}.",
             f"Planned for at most {budget_s:.0f} s (set-up + each phase's timeouts, within the deadline).", ""]
    if mode != "full":
        lines += [f"**Nothing ran on a GPU ({mode})**: each step's plumbing was checked instead.", ""]
    lines += ["| step | phase | status | wall s | timeout s | detail |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.phase} | {r.status} | {r.wall_s:.0f} | {r.timeout_s:.0f} | "
              f"{r.detail.replace('|', '/')} |" for r in results]
    lines += ["", "Steps: " + "; ".join(f"**{r.name}**: {r.what}" for r in results), ""]
    if mode == "full":
        lines += targets_markdown(evaluate({r.name: r.output for r in results if r.status == "pass"}))
    for r in results:
        if r.output and r.status == "pass":
            lines += [f"## {r.name}: figures", "", f"`{r.command}`", "", "```", *r.output, "```", ""]
        if r.log_tail:
            lines += [f"## {r.name}: {r.status}, the end of its log", "", f"`{r.command}`", "", "```", *r.log_tail,
                      "```", ""]
    lines += ["Logs: " + ", ".join(f"`{r.log}`" for r in results if r.log) if any(r.log for r in results)
              else "No logs (nothing ran)."]
    md = out / "summary.md"
    md.write_text("\n".join(lines) + "\n")
    if also is not None:
        also.mkdir(parents=True, exist_ok=True)
        for name in ("summary.md", "summary.json"):
            shutil.copyfile(out / name, also / name)
    return md


def main(argv: list[str] | None = None) -> int:
    """Run (or, with --dry or without CUDA, check) the plan; write the summary; 0 if every step passed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check", help="summary, logs and results directories (default gpu_check)")
    ap.add_argument("--dry", action="store_true", help="check each step's plumbing; run nothing")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--smoke-outputs", default=os.environ.get("SMOKE_OUTPUTS", ",".join(SMOKE_SAMPLE)),
                    help="'all' (the whole smoke DAG) or comma-separated output names (default: the sample)")
    ap.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    ap.add_argument("--timeout", action="append", default=[], metavar="STEP=SECONDS", help="override a timeout")
    ap.add_argument("--sgpt-official", default=None, type=Path,
                    help="a checkout of github.com/ubc-tea/SGPT: also time SGPT's round beside its model (+40 s)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds the whole check may take: a step starting late gets only what is left (default "
                         f"{PLAN_BUDGET_S}, none with --smoke-outputs all; 0: no deadline)")
    ap.add_argument("--summary-to", default=None, help="also keep summary.md/json in this directory, rewritten as "
                                                       "the check goes (e.g. a folder that is collected)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    also = Path(a.summary_to).resolve() if a.summary_to else None
    (out / "logs").mkdir(parents=True, exist_ok=True)
    smoke = "all" if a.smoke_outputs == "all" else [x for x in a.smoke_outputs.split(",") if x]
    steps = plan(out, a.cores, smoke, sgpt_official=a.sgpt_official.resolve() if a.sgpt_official else None)
    budget_s = a.budget if a.budget is not None else (0 if smoke == "all" else PLAN_BUDGET_S)
    start = time.monotonic()
    for spec in a.timeout:
        name, _, secs = spec.partition("=")
        hits = [s for s in steps if s.name == name]
        if not hits or not secs:
            ap.error(f"--timeout {spec!r}: expected STEP=SECONDS with STEP one of {[s.name for s in steps]}")
        hits[0].timeout_s = float(secs)
    if a.only:
        wanted = a.only.split(",")
        unknown = sorted(set(wanted) - {s.name for s in steps})
        if unknown:
            ap.error(f"--only: unknown steps {unknown}; steps: {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in wanted]
    env = _env_info(sys.executable)
    cuda = env["cuda_available"] == "True"
    mode = "full" if cuda and not a.dry else "dry" if a.dry else "no CUDA"
    results: list[Result] = []
    budget = min(plan_wall_s(steps), budget_s) if budget_s else plan_wall_s(steps)

    def left(deadline_s: float, about_to_start: list[Step]) -> None:
        """Cut the timeouts of steps about to start to what is left of the deadline (none when it is 0)."""
        if deadline_s:
            for name, old, new in cap_to_deadline(about_to_start, deadline_s - SETUP_S - (time.monotonic() - start),
                                                   deadline_s):
                print(f"gpu_check: {name}'s timeout cut from {old:.0f} s to {new:.0f} s (budget)", flush=True)
    order = [s.name for s in steps]

    def snapshot(partial: list[Result]) -> None:
        """The summary so far: the finished steps and the running ones (``partial``)."""
        write_summary(out, mode, env, sorted(results + partial, key=lambda r: order.index(r.name)), budget, also)

    for phase in sorted({s.phase for s in steps}):
        todo = []
        for s in (x for x in steps if x.phase == phase):
            why_not = smoke_missing() if s.name == "smoke" else None
            if why_not:
                results.append(Result(s.name, phase, "skipped", s.what, " ".join(s.argv), s.timeout_s, detail=why_not))
            elif mode != "full":
                ok, detail = check(s)
                results.append(Result(s.name, phase, "dry-ok" if ok else "dry-fail", s.what, " ".join(s.argv),
                                      s.timeout_s, detail=detail if mode == "dry" else f"no CUDA: not run; {detail}"))
            else:
                todo.append(s)
        if todo:
            print(f"phase {phase}: {', '.join(s.name for s in todo)}", flush=True)
            if phase == 1:   # one by one: the benchmarks' figures undisturbed
                for s in todo:
                    left(budget_s, [s])
                    results += run_phase([s], out / "logs", snapshot)
                    snapshot([])
            else:
                left(budget_s, todo)
                results += run_phase(todo, out / "logs", snapshot)
        refused = next((strict_refusal_in(Path(r.log)) for r in results   # read once, after the preflight's phase
                        if r.name == "strict_preflight" and r.phase == phase and r.status != "pass" and r.log), None)
        if refused:   # every training job would stop at it: the pipelines still run, without strict mode
            print(f"gpu_check: strict mode refused {refused}; the pipelines run with deterministic=false", flush=True)
            without_strict_mode([s for s in steps if s.phase > phase], refused)
        results.sort(key=lambda r: order.index(r.name))
        write_summary(out, mode, env, results, budget, also)   # after every phase: a killed check leaves what it had
    md = write_summary(out, mode, env, results, budget, also)
    print(md.read_text())
    return 0 if all(r.status in ("pass", "dry-ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
