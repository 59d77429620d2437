"""The Snakemake workflow end to end on a micro config, and incremental reruns proven by dry runs.

The workflow and a copy of the fedcore package are placed in a temporary directory, which is put first
on PYTHONPATH, so the tests can edit a method's file or an experiment's config without touching the
repository.
"""
from __future__ import annotations

import ast
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MICRO_METHODS = ["head_tune", "sgpt"]
MICRO_VARIANT = "sgpt_qg"  # one variant, in sgpt_c100_s10 only
MICRO_EXPERIMENTS = {"sgpt_c100_s50", "sgpt_c100_s10", "sgpt_five"}  # label shift (s = 50, 10) and feature shift
NOT_RUN = ("sgpt_office", "sgpt_domainnet")  # `methods: []` at the micro scale: their cells say "not configured"
TRAINING_RULES = {"fetch_dataset", "build_dataset", "pretrain_backbone", "partition", "features"}
CODE = "results/code/fedcore/"  # a job's code inputs: its fedcore files' fingerprints (fedcore/code_inputs.py)
CODE_EDIT = "\n_EDITED = True\n"  # a change to what a module runs (a comment alone reruns nothing)
RUN_LOG = "micro_run.log"  # the workspace's run, as Snakemake printed it


def _env(workdir: Path) -> dict[str, str]:
    """A job's environment: the workspace's fedcore first, one OpenMP thread where a rule sets none, and OpenMP's
    idle threads asleep, not spinning: the 2-thread pretraining job beside the other pytest worker (and any other
    process) otherwise spins on a busy core (measured: 930 against 1,670 img/s beside one busy process, 90 against
    about 2,000 beside two; the same code and numbers either way)."""
    return {**os.environ, "PYTHONPATH": str(workdir), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def _snakemake(workdir: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = _env(workdir)
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _edit_yaml(path: Path, edit) -> None:
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _micro(doc: dict) -> None:
    """The micro methods in SGPT's paper experiments; none in an experiment a user added beside them."""
    for name, exp in doc["experiments"].items():
        if name not in MICRO_EXPERIMENTS and name not in NOT_RUN:
            exp["methods"] = []
            continue
        exp["methods"] = list(MICRO_METHODS) + ([MICRO_VARIANT] if name == "sgpt_c100_s10" else [])


def _micro_scale(doc: dict) -> None:
    doc["federation"] = {"rounds": 2, "local_epochs": 1}


def _micro_sgpt_scale(doc: dict) -> None:
    doc["report"] = {"window": "last", "rounds": 2}
    for name, exp in doc["experiments"].items():
        exp.pop("methods", None)
        if name in NOT_RUN:
            exp["methods"] = []


def micro_copy(work: Path) -> Path:
    """The workflow and fedcore copied into ``work`` with the micro config (nothing run yet)."""
    for item in ("Snakefile", "rules", "workflow", "config", "profiles", "fedcore", "DEVIATIONS.md"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item)
    # SGPT alone, every table and figure: the micro run checks the machinery, not the default's selection
    _edit_yaml(work / "config" / "config.yaml", lambda d: d.update(papers=["sgpt"], outputs="all"))
    _edit_yaml(work / "config" / "experiments" / "sgpt.yaml", _micro)
    _edit_yaml(work / "config" / "scales" / "mini.yaml", _micro_scale)
    _edit_yaml(work / "config" / "scales" / "mini" / "sgpt.yaml", _micro_sgpt_scale)
    _edit_yaml(work / "config" / "backbones.yaml", lambda d: d["vit_mini"]["pretrain"].update(epochs=1))
    return work


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A finished micro run: every default target built once, on 2 methods x 3 experiments, 2 rounds."""
    work = micro_copy(tmp_path_factory.mktemp("wf"))
    run = _snakemake(work, timeout=420)
    assert run.returncode == 0, run.stderr[-4000:]
    (work / RUN_LOG).write_text(run.stdout + run.stderr)  # every job's rule and inputs, as Snakemake printed them
    return work


def _planned_jobs(work: Path, *args: str) -> list[tuple[str, dict]]:
    """(rule, wildcards) of every job a dry run would execute."""
    out = _snakemake(work, "-n", *args)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs, rule = [], None
    for line in out.stdout.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):", line.strip())
        if m:
            rule = m.group(1)
            jobs.append((rule, {}))
        m = re.match(r"^wildcards: (.*)$", line.strip())
        if m and jobs:
            jobs[-1][1].update(dict(kv.split("=", 1) for kv in m.group(1).split(", ")))
    return jobs


def _job_blocks(stdout: str) -> list[tuple[str, str]]:
    """(rule, text) of every job a dry run prints."""
    return [(m.group(1), b) for b in re.split(r"^(?=(?:local)?rule \w+:)", stdout, flags=re.M)
            if (m := re.match(r"(?:local)?rule (\w+):", b))]


def test_pipeline_writes_metrics_tables_figures(workspace):
    metrics = pd.read_parquet(workspace / "results" / "metrics.parquet")
    assert set(metrics["method"]) == set(MICRO_METHODS) | {MICRO_VARIANT}
    assert set(metrics["experiment"]) == MICRO_EXPERIMENTS
    assert sorted(metrics["round"].unique()) == [1, 2]
    assert (metrics["metric"] == "select_cluster_acc").any()  # SGPT's Select scored against coarse labels
    for ext in ("md", "tex", "csv"):
        assert (workspace / "results" / "tables" / f"sgpt_table1.{ext}").stat().st_size > 0
    md = (workspace / "results" / "tables" / "sgpt_table1.md").read_text()
    assert "not configured" in md  # fedvpt is not in the micro config
    # each cell with a number knows its test images (read from the partition file) and its interval
    csv = pd.read_csv(workspace / "results" / "tables" / "sgpt_table1.csv")
    ok = csv.loc[csv["status"] == "ok"]
    assert len(ok) and ok["test_images"].notna().all() and (ok["ci95_low"] <= ok["ours"]).all()
    assert (ok["ours"] <= ok["ci95_high"]).all() and "Test images behind each column" in md
    for ext in ("png", "pdf"):
        assert (workspace / "results" / "figures" / f"sgpt_accuracy_per_round.{ext}").stat().st_size > 1000
    heatmaps = list((workspace / "results" / "partitions").glob("*/*/seed0.heatmap.png"))
    assert len(heatmaps) == 3  # s=50, s=10 and five analogues (office and domainnet are not run)
    queries = list((workspace / "results" / "features").glob("vit_mini/*/cls_block*.npz"))
    assert len(queries) == 2   # label shift: the last block of digits and digits_five



def test_the_run_kept_every_sources_parsed_facts_for_the_next_call(workspace):
    """The run saved, by each source's bytes, what the DAG parsed (code fingerprints, imports): every fedcore file and
    every workflow script its jobs run, with the fingerprints their code inputs hold, so the next `snakemake` call
    parses nothing that did not change (fedcore/code_inputs.py ``keep_facts_in``)."""
    import hashlib

    from fedcore.code_inputs import _cache_version

    saved = json.loads((workspace / "results" / "cache" / "code_facts.json").read_text())
    assert saved["version"] == _cache_version()  # the copy's code_inputs.py is this checkout's
    scripts = [workspace / "workflow" / "scripts" / f.name.removesuffix(".sha256")
               for f in (workspace / "results" / "code" / "workflow" / "scripts").glob("*.sha256")]
    sources = [*(workspace / "fedcore").rglob("*.py"), *scripts]
    facts = {f: saved["values"].get(hashlib.sha256(f.read_bytes()).hexdigest()) for f in sources}
    assert not [f for f, fact in facts.items() if fact is None]
    # saved when the DAG was built (the Snakefile's onstart), before any job ran: a long run's SLURM jobs read it
    first = min(f.stat().st_mtime_ns for f in (workspace / "results" / "data").glob("*.npz"))
    assert (workspace / "results" / "cache" / "code_facts.json").stat().st_mtime_ns < first
    for name in ("fedcore/engine/loop.py", "workflow/scripts/train.py"):
        held = (workspace / "results" / "code" / f"{name}.sha256").read_text().split()[0]
        assert facts[workspace / name]["fingerprint"] == held


def _report_var(text: str, name: str) -> dict:
    """A JSON object the Snakemake report assigns to a JavaScript variable."""
    return json.loads(re.search(rf"^\s*var {name} = (\{{.*\}});\s*$", text, re.M).group(1))


def test_report_holds_every_table_and_figure_under_its_paper(workspace):
    """`snakemake --report`: one self-contained HTML file; every table and figure the config defines is an item
    of its paper's section with a caption that names the scale, beside the run inventory and the deviations
    (about 6 s on the micro run)."""
    from fedcore.config import load_config

    out = _snakemake(workspace, "--report", "results/report.html")
    assert out.returncode == 0, out.stderr[-3000:]
    text = (workspace / "results" / "report.html").read_text(encoding="utf-8")
    categories, results = _report_var(text, "categories"), _report_var(text, "results")
    cfg = load_config(yaml.safe_load((workspace / "config" / "config.yaml").read_text()), workspace)
    items = "results/report/items"
    assert sorted(categories) == ["1. SGPT", "5. Choices and deviations"]
    sgpt = categories["1. SGPT"]
    assert sorted(sgpt["Tables"]) == sorted(f"{items}/tables/{t}.html" for t in cfg.tables if t in cfg.outputs)
    assert sorted(sgpt["Figures"]) == sorted(f"{items}/figures/{f}.html" for f in cfg.figures if f in cfg.outputs)
    assert set(cfg.outputs) == set(cfg.tables) | set(cfg.figures)  # the micro config builds every output
    assert sgpt["Runs"] == [f"{items}/report/sgpt_runs.html"]
    assert sgpt["Claim check"] == [f"{items}/report/sgpt_claims.html"]
    assert [p for sub in categories["5. Choices and deviations"].values() for p in sub] == \
        [f"{items}/report/deviations.html"]
    for name, entry in [*cfg.tables.items(), *cfg.figures.items()]:
        item = next(r for path, r in results.items() if Path(path).stem == name)
        assert "Scale mini" in item["caption"] and entry["caption"].split(":")[0] in item["caption"]
        # listed by title; the info panel shows the caption, not the config the building job carried
        assert item["labels"]["title"] in entry["caption"] or item["labels"]["title"] == name
        assert "{" not in item["job_properties"]["params"]
    table1 = results[f"{items}/tables/sgpt_table1.html"]["data_uri"]
    page = base64.b64decode(table1.split(",", 1)[1]).decode("utf-8")
    assert "C100 Global s=50" in page and "not configured" in page and 'class="paper"' in page
    fig1 = base64.b64decode(results[f"{items}/figures/sgpt_fig1.html"]["data_uri"].split(",", 1)[1]).decode("utf-8")
    assert "<figcaption" in fig1 and "Scale mini" in fig1 and "data:image/png;base64," in fig1
    # the front page is the summary: its counts are the claim check's
    desc = json.loads(re.search(r"^\s*var workflow_desc = (.*);\s*$", text, re.M).group(1))
    assert "Summary: scale mini" in desc and "items/report/sgpt_claims.html" in desc


def test_summary_counts_are_the_claim_checks(workspace):
    claims = pd.read_csv(workspace / "results" / "report" / "sgpt_claims.csv")
    summary = pd.read_csv(workspace / "results" / "report" / "summary.csv").set_index("paper")
    counts = claims.loc[claims["scale"] == "mini", "verdict"].value_counts()
    from fedcore.claim_rules import VERDICTS

    assert summary.loc["sgpt", "claims"] == (claims["scale"] == "mini").sum()
    assert {v: summary.loc["sgpt", v] for v in VERDICTS} == {v: counts.get(v, 0) for v in VERDICTS}
    # every training job recorded its own time (workflow/scripts/_log.py): the summary timed them all
    assert summary.loc["sgpt", "runs_timed"] == summary.loc["sgpt", "runs_selected"] > 0
    assert summary.loc["sgpt", "cpu_s"] > 0 and summary.loc["sgpt", "wall_s"] > 0


def test_editing_any_file_a_training_job_imports_reruns_it(workspace):
    """Every fedcore file edited at once, the jobs before training (data, partitions, backbones, features) kept up to
    date, one dry run: every training job reruns, and its updated inputs are exactly the fedcore files it runs (its
    code inputs: the files a fresh process imports, tests/test_code_inputs.py), so an edit of any one of them alone
    reruns it; no report, analysis or configuration file is among them, and a method's file only in its own runs."""
    files = sorted((workspace / "fedcore").rglob("*.py"))
    originals = {f: f.read_bytes() for f in files}
    upstream = [p for d in ("data", "partitions", "backbones", "features") for p in (workspace / "results" / d).rglob("*")
                if p.is_file()]
    stamps = {p: (p.stat().st_atime_ns, p.stat().st_mtime_ns) for p in upstream}
    try:
        for f in files:
            f.write_bytes(originals[f] + CODE_EDIT.encode())
        later = time.time_ns() + 3600 * 10**9  # their outputs newer than any edit and fingerprint: they stay done
        for p in upstream:
            os.utime(p, ns=(later, later))
        out = _snakemake(workspace, "-n")
        assert out.returncode == 0, out.stderr[-3000:]
    finally:  # same bytes again (Snakemake compares the recorded checksums) and the outputs' own times
        for f, data in originals.items():
            f.write_bytes(data)
        for p, (atime, mtime) in stamps.items():
            os.utime(p, ns=(atime, mtime))
    jobs = _job_blocks(out.stdout)
    trains = [b for rule, b in jobs if rule == "train"]
    assert len(trains) == len(MICRO_EXPERIMENTS) * len(MICRO_METHODS) + 1
    assert not {rule for rule, _ in jobs} & TRAINING_RULES
    for block in trains:
        code = {i for i in re.search(r"input: (.*)", block).group(1).split(", ") if i.startswith(CODE)}
        updated = re.search(r"reason: Updated input files: ([^;\n]*)", block).group(1).split(", ")
        assert {u for u in updated if u.startswith(CODE)} == code and f"{CODE}engine/evaluate.py.sha256" in code
        code = {c.removeprefix("results/code/").removesuffix(".sha256") for c in code}
        assert not {c for c in code if c.startswith(("fedcore/report/", "fedcore/analysis/", "fedcore/config/"))}
        method = re.search(r"method=(\w+)", block).group(1)
        own = "fedcore/methods/head_tune.py" if method == "head_tune" else "fedcore/methods/sgpt.py"
        other = "fedcore/methods/sgpt.py" if method == "head_tune" else "fedcore/methods/head_tune.py"
        assert own in code and other not in code, method
    assert _planned_jobs(workspace) == []   # restored: nothing left to do


def test_nothing_to_do_after_a_complete_run_moved_or_with_only_comments_edited(workspace):
    """A complete run leaves nothing to do, from a moved checkout too (params and code inputs are relative to it: an
    absolute checksums path once reran every job), with every fedcore file and workflow script given new comments and
    blank lines and its module docstring reworded at once: the code's fingerprints are unchanged (a docstring fix in
    the engine must not retrain every run; nor a comment in train.py, which Snakemake's own `code` trigger, off in the
    profiles, would see). One dry run for the three."""
    moved = workspace.with_name(workspace.name + "_moved")
    workspace.rename(moved)
    files = sorted([*(moved / "fedcore").rglob("*.py"), *(moved / "workflow" / "scripts").glob("*.py")])
    originals = {f: f.read_text() for f in files}
    try:
        for f, text in originals.items():
            lines = text.splitlines(keepends=True)
            tree = ast.parse(text)
            if ast.get_docstring(tree) is not None:  # reworded where its opening quotes are
                n = tree.body[0].lineno - 1
                lines[n] = re.sub(r'("""|\'\'\'|"|\')', r"\1Reworded. ", lines[n], count=1)
            f.write_text("# a new comment\n\n" + "".join(lines) + "\n\n# the end\n")
        out = _snakemake(moved, "-n")
    finally:
        for f, text in originals.items():
            f.write_text(text)
        moved.rename(workspace)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _job_blocks(out.stdout) == [], out.stdout[-3000:]


def _rule_scripts(work: Path) -> dict[str, str]:
    """Each rule's workflow script (its `script:`), read from the rule files."""
    out = {}
    for f in (work / "rules").glob("*.smk"):
        for block in re.split(r"^(?=(?:local)?rule \w+:)", f.read_text(), flags=re.M):
            rule = re.match(r"(?:local)?rule (\w+):", block)
            script = re.search(r'script:\s*"[./]*workflow/scripts/([\w.]+)"', block)
            if rule and script:
                out[rule.group(1)] = script.group(1)
    return out


def test_every_job_declares_its_scripts_fingerprint(workspace):
    """Each job of the workspace's run (the whole DAG) had its own workflow script's fingerprint among its inputs: with
    Snakemake's `code` trigger off (the profiles), that input is what reruns a job whose script's code changed."""
    by_rule, blocks = _rule_scripts(workspace), _job_blocks((workspace / RUN_LOG).read_text())
    assert {r for r, _ in blocks} >= {"train", "table", "figure", "partition", "pretrain_backbone", "summary"}
    for rule, block in blocks:
        if rule == "all":  # the targets: no script
            continue
        inputs = re.search(r"input: (.*)", block).group(1).split(", ")
        assert f"results/code/workflow/scripts/{by_rule[rule]}.sha256" in inputs, (rule, inputs)


def _reasons(block: str) -> dict[str, str]:
    """A dry-run job's reasons by kind ("Updated input files", "Params have changed since last execution", ...)."""
    line = re.search(r"reason: (.*)", block).group(1)
    return dict(part.split(": ", 1) if ": " in part else (part, "") for part in line.split("; "))


def _updated_code(block: str) -> list[str]:
    """The code inputs (fingerprints) among a job's updated inputs."""
    return sorted(f for f in _reasons(block).get("Updated input files", "").split(", ") if f.startswith("results/code/"))


def _dry_run_with(workspace: Path, edits: dict[Path, str], *args: str) -> list[tuple[str, str]]:
    """(rule, text) of every job a dry run plans with ``edits`` (path -> new text) in place; the files restored."""
    originals = {p: p.read_bytes() for p in edits}
    try:
        for p, text in edits.items():
            p.write_text(text)
        out = _snakemake(workspace, "-n", *args)
    finally:
        for p, data in originals.items():
            p.write_bytes(data)
    assert out.returncode == 0, out.stderr[-3000:]
    return _job_blocks(out.stdout)


def _train_blocks(blocks) -> dict[tuple[str, str, str], str]:
    """(experiment, method, seed) -> its job's text, for the training jobs among ``blocks``."""
    key = lambda b: tuple(re.search(rf"{k}=(\w+)", b).group(1) for k in ("experiment", "method", "seed"))
    return {key(b): b for r, b in blocks if r == "train"}


def test_independent_edits_rerun_only_their_own_jobs(workspace):
    """Four edits in one dry run, each training job's reason naming its own: a method's code reruns only that method's
    runs; a variant's params only its runs; an experiment's settings its runs and not its partition; a report module's
    code the tables and no training, nor anything before it. (Snakemake names one reason of a job, so the edits touch
    different runs: the experiment's head_tune run reruns for its method's code first.)"""
    exp_file = workspace / "config" / "experiments" / "sgpt.yaml"
    doc = yaml.safe_load(exp_file.read_text())
    doc["variants"][MICRO_VARIANT]["params"]["key_momentum"] = 0.1
    doc["experiments"]["sgpt_c100_s50"]["optimizer"]["lr"] = 0.02
    method, report = workspace / "fedcore" / "methods" / "head_tune.py", workspace / "fedcore" / "report" / "tables.py"
    blocks = _dry_run_with(workspace, {method: method.read_text() + CODE_EDIT, report: report.read_text() + CODE_EDIT,
                                       exp_file: yaml.safe_dump(doc, sort_keys=False)})
    trains = _train_blocks(blocks)
    code = {(e, "head_tune", "0") for e in MICRO_EXPERIMENTS}
    params = {("sgpt_c100_s10", MICRO_VARIANT, "0"), ("sgpt_c100_s50", "sgpt", "0")}
    assert set(trains) == code | params
    for run, block in trains.items():
        why = _reasons(block)
        if run in code:
            assert _updated_code(block) == [f"{CODE}methods/head_tune.py.sha256"], block
        else:
            assert list(why) == ["Params have changed since last execution"], block
    assert not {r for r, _ in blocks} & TRAINING_RULES
    # each table reruns for tables.py, or first for the metrics the rerun training updates
    tables = [_reasons(b) for r, b in blocks if r == "table"]
    assert any(f"{CODE}report/tables.py.sha256" in why.get("Updated input files", "") for why in tables)
    assert all(f"{CODE}report/tables.py.sha256" in why.get("Updated input files", "")
               or "Input files updated by another job" in why for why in tables), tables


def test_a_workflow_scripts_code_reruns_its_jobs_and_a_new_seed_runs_only_itself(workspace):
    """train.py's code edited and a second seed added, in one dry run: every training job of seed 0 reruns for the
    script (its fingerprint its only updated input); seed 1 runs every run with its partitions; no dataset, backbone
    or feature job runs again."""
    script = workspace / "workflow" / "scripts" / "train.py"
    blocks = _dry_run_with(workspace, {script: script.read_text() + CODE_EDIT}, "--config", "seeds=[0,1]")
    trains = _train_blocks(blocks)
    runs = {(e, m) for e in MICRO_EXPERIMENTS for m in MICRO_METHODS} | {("sgpt_c100_s10", MICRO_VARIANT)}
    assert set(trains) == {(e, m, s) for e, m in runs for s in ("0", "1")}
    for (e, m, seed), block in trains.items():
        why = _reasons(block)
        if seed == "0":
            assert why == {"Updated input files": "results/code/workflow/scripts/train.py.sha256"}, block
        else:
            assert "Missing output files" in why, block
    assert {re.search(r"seed=(\d+)", b).group(1) for r, b in blocks if r == "partition"} == {"1"}
    assert not {r for r, _ in blocks} & (TRAINING_RULES - {"partition"})


def test_interrupting_snakemake_alone_keeps_the_run_and_its_log(workspace):
    """SIGINT to Snakemake's process only (not its group): the job finishes, Snakemake marks its outputs
    incomplete; the rerun (rerun-incomplete, the default profile) deletes them and the job's log, and the job
    rebuilds them from the kept checkpoint, without training, its log holding both attempts."""
    run = Path("results/runs/mini/sgpt_c100_s50/head_tune/seed0")
    target, log = str(run / "metrics.parquet"), workspace / "results/logs/train/mini/sgpt_c100_s50/head_tune/seed0.log"
    stamps = {f: os.stat(workspace / run / f).st_mtime_ns for f in ("metrics.parquet", "final.pt")}
    for kept in ("checkpoint.pt", "attempts.log"):  # the first attempt trains from round 1
        (workspace / run / kept).unlink(missing_ok=True)
    env = _env(workspace)
    with open(workspace / "interrupted.txt", "w") as out:
        smk = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", "--force", target], cwd=workspace,
                               env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        incomplete = workspace / ".snakemake" / "incomplete"
        deadline = time.monotonic() + 120
        while not (incomplete.is_dir() and any(incomplete.iterdir())):  # the job has started
            assert smk.poll() is None and time.monotonic() < deadline, (workspace / "interrupted.txt").read_text()
            time.sleep(0.05)
        os.kill(smk.pid, signal.SIGINT)
        assert smk.wait(timeout=180) != 0
    assert any(incomplete.iterdir()) and "resuming" not in log.read_text()  # trained from round 1, then marked
    first = pd.read_parquet(workspace / target)
    rerun = _snakemake(workspace, target)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    text = log.read_text()
    marker = text.index("attempt 2 of this job; the log above is from the earlier attempts")
    assert "global_acc" in text[:marker] and "resuming from round 2 of 2" in text[marker:]
    pd.testing.assert_frame_equal(pd.read_parquet(workspace / target), first)
    for f, ns in stamps.items():  # as before the test, so that the other tests' dry runs plan nothing
        os.utime(workspace / run / f, ns=(ns, ns))
