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


def _snakemake(workdir: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(workdir), "OMP_NUM_THREADS": "1"}
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


def _train_jobs(jobs):
    return sorted((w["experiment"], w["method"], w["seed"]) for r, w in jobs if r == "train")


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


def test_nothing_to_do_after_a_complete_run(workspace):
    assert _planned_jobs(workspace) == []


def test_moving_the_checkout_reruns_nothing(workspace):
    """Params and code inputs are relative to the checkout (an absolute checksums path once reran every job)."""
    moved = workspace.with_name(workspace.name + "_moved")
    workspace.rename(moved)
    try:
        assert _planned_jobs(moved) == []
    finally:
        moved.rename(workspace)


def test_editing_one_method_reruns_only_its_jobs(workspace):
    src = workspace / "fedcore" / "methods" / "head_tune.py"
    original = src.read_text()
    try:
        src.write_text(original + CODE_EDIT)
        jobs = _planned_jobs(workspace)
        assert _train_jobs(jobs) == [(e, "head_tune", "0") for e in sorted(MICRO_EXPERIMENTS)]
        assert not {r for r, _ in jobs} & TRAINING_RULES
    finally:
        src.write_text(original)


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


def test_editing_only_comments_docstrings_or_layout_reruns_nothing(workspace):
    """Every fedcore file and workflow script given new comments and blank lines and its module docstring reworded,
    at once: the code's fingerprints are unchanged, so nothing reruns (a docstring fix in the engine must not retrain
    every run; nor a comment in train.py, which Snakemake's own `code` trigger, off in the profiles, would see)."""
    files = sorted([*(workspace / "fedcore").rglob("*.py"), *(workspace / "workflow" / "scripts").glob("*.py")])
    originals = {f: f.read_text() for f in files}
    try:
        for f, text in originals.items():
            lines = text.splitlines(keepends=True)
            tree = ast.parse(text)
            if ast.get_docstring(tree) is not None:  # reworded where its opening quotes are
                n = tree.body[0].lineno - 1
                lines[n] = re.sub(r'("""|\'\'\'|"|\')', r"\1Reworded. ", lines[n], count=1)
            f.write_text("# a new comment\n\n" + "".join(lines) + "\n\n# the end\n")
        jobs = _planned_jobs(workspace)
    finally:
        for f, text in originals.items():
            f.write_text(text)
    assert jobs == []


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


def test_editing_a_workflow_scripts_code_reruns_its_jobs(workspace):
    """train.py's code edited: every training job reruns for it (its fingerprint updated), nothing before training."""
    src = workspace / "workflow" / "scripts" / "train.py"
    original = src.read_bytes()
    try:
        src.write_bytes(original + CODE_EDIT.encode())
        out = _snakemake(workspace, "-n")
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        src.write_bytes(original)
    blocks = _job_blocks(out.stdout)
    trains = [b for r, b in blocks if r == "train"]
    assert len(trains) == len(MICRO_EXPERIMENTS) * len(MICRO_METHODS) + 1
    assert not {r for r, _ in blocks} & TRAINING_RULES
    for block in trains:
        updated = re.search(r"reason: Updated input files: ([^;\n]*)", block).group(1).split(", ")
        assert updated == ["results/code/workflow/scripts/train.py.sha256"], updated


def test_editing_code_no_training_job_imports_reruns_no_training(workspace):
    """A report module (fedcore/report/tables.py): the tables rerun, no training job nor anything before them."""
    src = workspace / "fedcore" / "report" / "tables.py"
    original = src.read_text()
    try:
        src.write_text(original + CODE_EDIT)
        rules = {r for r, _ in _planned_jobs(workspace)}
    finally:
        src.write_text(original)
    assert "table" in rules and not rules & (TRAINING_RULES | {"train"})


def test_editing_one_variant_reruns_only_its_runs(workspace):
    path = workspace / "config" / "experiments" / "sgpt.yaml"
    original = path.read_text()
    try:
        _edit_yaml(path, lambda d: d["variants"][MICRO_VARIANT]["params"].update(key_momentum=0.1))
        assert _train_jobs(_planned_jobs(workspace)) == [("sgpt_c100_s10", MICRO_VARIANT, "0")]
    finally:
        path.write_text(original)


def test_editing_one_experiment_reruns_only_its_jobs(workspace):
    path = workspace / "config" / "experiments" / "sgpt.yaml"
    original = path.read_text()
    try:
        _edit_yaml(path, lambda d: d["experiments"]["sgpt_c100_s10"]["optimizer"].update(lr=0.02))
        jobs = _planned_jobs(workspace)
        assert _train_jobs(jobs) == [("sgpt_c100_s10", m, "0") for m in sorted(MICRO_METHODS + [MICRO_VARIANT])]
        assert not [w for r, w in jobs if r == "partition"]
    finally:
        path.write_text(original)


def test_adding_a_seed_runs_only_the_new_seed(workspace):
    jobs = _planned_jobs(workspace, "--config", "seeds=[0,1]")
    trains = _train_jobs(jobs)
    assert trains and {s for _, _, s in trains} == {"1"} and len(trains) == len(MICRO_EXPERIMENTS) * len(MICRO_METHODS) + 1
    assert {w["seed"] for r, w in jobs if r == "partition"} == {"1"}
    assert not [r for r, _ in jobs if r in ("pretrain_backbone", "build_dataset")]


def test_interrupting_snakemake_alone_keeps_the_run_and_its_log(workspace):
    """SIGINT to Snakemake's process only (not its group): the job finishes, Snakemake marks its outputs
    incomplete; the rerun (rerun-incomplete, the default profile) deletes them and the job's log, and the job
    rebuilds them from the kept checkpoint, without training, its log holding both attempts."""
    run = Path("results/runs/mini/sgpt_c100_s50/head_tune/seed0")
    target, log = str(run / "metrics.parquet"), workspace / "results/logs/train/mini/sgpt_c100_s50/head_tune/seed0.log"
    stamps = {f: os.stat(workspace / run / f).st_mtime_ns for f in ("metrics.parquet", "final.pt")}
    for kept in ("checkpoint.pt", "attempts.log"):  # the first attempt trains from round 1
        (workspace / run / kept).unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(workspace), "OMP_NUM_THREADS": "1"}
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
