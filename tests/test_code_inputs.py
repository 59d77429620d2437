"""Code inputs derived from imports (fedcore/code_inputs.py): a default training job's, and one run's of every method
and variant, are exactly the fedcore files the job imports, measured in a fresh process; so an edit to any file it
imports reruns it, and an edit to any other file reruns nothing (tests/test_workflow.py shows both on Snakemake
itself)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedcore.artifacts import artifact_module
from fedcore.artifacts.select_queries import compute_select_queries
from fedcore.backbones.pretrain import objective_module
from fedcore.code_inputs import ROOT as PACKAGE_DIR, code_files, fingerprint, import_graph, script_modules, write_fingerprint
from fedcore.config import load_config
from fedcore.methods import method_module
from fedcore.methods.sgpt import QUERY
from fedcore.partition.registry import scheme_modules
from fedcore.plan import plan_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "workflow" / "scripts"
# imported by the scripts' helpers _log.py and _gpu.py only: where a job logs and which GPU it takes change none of
# its outputs, so they are no code inputs (an edit to them reruns nothing)
GLUE = {"runtime/joblog.py", "runtime/jobtime.py", "runtime/gpu_slots.py"}

# Run in a fresh interpreter: first workflow/scripts/train.py itself, as Snakemake runs it (a `snakemake` object), on a
# tiny SGPT run that reads its Select queries; then, per (method, artifact keys), fedcore.train (what the script
# imports) and the run's plug-ins by the paths a run loads them (method_class, load_artifact), from no fedcore module
# loaded. Prints the fedcore files loaded after each, relative to the package.
PROBE = r"""
import importlib, json, runpy, sys, types
from pathlib import Path

spec = json.loads(sys.argv[1])

class Named(dict):
    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

def loaded():
    root = Path(sys.modules["fedcore"].__file__).parent
    return sorted(str(Path(m.__file__).relative_to(root)) for n, m in list(sys.modules.items())
                  if (n == "fedcore" or n.startswith("fedcore.")) and getattr(m, "__file__", None))

def purge():
    for name in [n for n in sys.modules if n == "fedcore" or n.startswith("fedcore.")]:
        del sys.modules[name]

run = spec["run"]
snakemake = types.SimpleNamespace(
    input=Named(run["input"]), output=Named(run["output"]), params=Named(run["params"]), log=[],
    resources=Named(gpu=0), threads=1, scriptdir=run["scriptdir"], wildcards=Named())
runpy.run_path(run["script"], init_globals={"snakemake": snakemake}, run_name="__main__")
out = {"run": loaded()}
for key, (method, artifacts) in spec["imports"].items():
    purge()
    importlib.import_module("fedcore.train")
    importlib.import_module("fedcore.methods").method_class(method)
    for artifact in artifacts:
        try:  # imports the kind's module, then finds no file
            importlib.import_module("fedcore.artifacts").load_artifact(artifact, "/nonexistent.npz", 0, 0, "cpu")
        except FileNotFoundError:
            pass
    out[key] = loaded()
print(json.dumps(out))
"""


def _derived(*modules: str, script: str = "train.py") -> set[str]:
    return {str(f) for f in code_files(*modules, script=SCRIPTS / script)}


@pytest.fixture(scope="module")
def default_plans():
    """The plan of every training job of the default configuration, then one run of every method and variant the mini
    configuration runs (tests/every_method.py), so that a method outside the default outputs is measured too."""
    from every_method import mini_config, representative_runs

    cfg = load_config(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), ROOT)
    plans = [plan_run(cfg, r["experiment"], r["method"], r["seed"]) for r in cfg.runs()]
    return plans + [plan_run(mini_config(), e, m, 0) for e, m in representative_runs()]


def _sgpt_job(files: dict, out: Path) -> dict:
    """A tiny SGPT training job's script, inputs, outputs and params (rules/train.smk's shape)."""
    params = {"groups": 2, "shared_blocks": [0], "group_blocks": [1], "select_block": 1}
    compute_select_queries(files["dataset"], "vit_mini", files["weights"], 1, out / "q.npz", device="cpu")
    cfg = {"paper": "sgpt", "method": "sgpt", "method_params": params, "final_window": 1,
           "federation": {"rounds": 1, "participation": 0.5, "local_epochs": 1, "batch_size": 32},
           "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
           "evaluation": {"global_test": "pooled_local"}}
    identity = {"paper": "sgpt", "experiment": "tiny", "method": "sgpt", "scale": "mini", "dataset": "synthetic",
                "seed": 0}
    return {"script": str(SCRIPTS / "train.py"), "scriptdir": str(SCRIPTS),
            "input": {"dataset": str(files["dataset"]), "partition": str(files["partition"]),
                      "backbone": str(files["weights"]), f"artifact_{QUERY}": str(out / "q.npz"), "code": []},
            "output": {"metrics": str(out / "m.parquet"), "final": str(out / "f.pt")},
            "params": {"cfg": cfg, "identity": identity, "arch": "vit_mini", "sha256": None,
                       "checkpoint": str(out / "ckpt.pt"), "log_history": None, "device": "cpu", "threads": 1,
                       "compile": None, "deterministic": True},
            "modules": [method_module("sgpt"), artifact_module("cls_block1")]}


def test_default_training_jobs_import_exactly_their_code_inputs(default_plans, tiny_run_files, tmp_path):
    """Every default training job's (and every method's and variant's) derived code inputs equal the fedcore files
    that loading its run imports, and a whole (tiny) training job, its workflow script included, imports its code
    inputs and the scripts' glue."""
    kinds = {p.modules: (p.params["method"], sorted(set(p.artifacts.values()))) for p in default_plans}
    job = _sgpt_job(tiny_run_files, tmp_path)
    spec = {"run": job, "imports": {"|".join(k): v for k, v in kinds.items()}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.splitlines()[-1])
    assert set(measured.pop("run")) == _derived(*job["modules"]) | GLUE
    for p in default_plans:
        assert set(measured["|".join(p.modules)]) == _derived(*p.modules), (p.experiment, p.identity["method"])
    # what the default runs import: engine, backbones, the run's method alone; never another method or the report
    union = set().union(*map(set, measured.values()))
    assert "backbones/plain_vit.py" in union and "engine/loop.py" in union and "methods/sgpt.py" in union
    assert not {f for f in union if f.startswith(("report/", "analysis/", "config/")) or f == "selection.py"}


def test_each_jobs_code_is_its_own():
    """A job's code is its script's imports and its run's plug-ins: another method, artifact kind, objective or the
    report are not among them."""
    sgpt = _derived(method_module("sgpt"), artifact_module("cls_block3"))
    assert {"methods/sgpt.py", "artifacts/select_queries.py", "train.py"} <= sgpt
    assert not {"methods/fedavg.py", "artifacts/clip_tokens.py", "methods/base.py"} & sgpt
    assert "methods/base.py" in _derived(method_module("fedavg"))  # a method's own imports come with it
    features = _derived(artifact_module("cls_block3"), script="features.py")
    assert "artifacts/select_queries.py" in features and "artifacts/clip_tokens.py" not in features
    partition = _derived(*scheme_modules(), script="make_partition.py")
    assert {"partition/schemes/fedotp.py", "partition/plots.py"} <= partition and "train.py" not in partition
    pretrain = _derived(objective_module("supervised"), script="pretrain_backbone.py")
    assert "backbones/pretrain/supervised.py" in pretrain and "backbones/pretrain/moco.py" not in pretrain
    table = _derived(script="make_table.py")
    assert "report/tables.py" in table and not {f for f in table if f.startswith(("engine/", "backbones/"))}


def test_scripts_and_graph_read_as_python_runs_them():
    """``from fedcore.a import b`` (b a module or a name), relative imports, and imports under TYPE_CHECKING."""
    assert script_modules(SCRIPTS / "train.py")[0] == "fedcore.train"
    graph = import_graph()
    assert "fedcore.estimate" in graph["fedcore.config.resolved"]                # a function's import counts too
    assert "fedcore.engine.roles" not in graph["fedcore.methods"]                # TYPE_CHECKING's never runs
    assert all(m in graph for targets in graph.values() for m in targets)


MODULE = '''"""A module."""
import os  # why


def f(x):
    """Doubles."""
    return 2 * x  # twice


class C:
    "A class."
    y = "not a docstring"

    def g(self, p: str) -> str:
        return f"{p} is {p.upper()!r} of {self.y + 'x'}"
'''


@pytest.mark.parametrize("edit, same", [
    (lambda s: "# a comment\n\n" + s + "\n\n", True),                          # comments, blank lines
    (lambda s: s.replace("2 * x", "(2) * x").replace("  # twice", ""), True),     # layout
    (lambda s: s.replace("A module.", "A reworded module.").replace("Doubles.", "Twice x.")
                .replace("A class.", "Reworded."), True),                        # docstrings
    (lambda s: s.replace("2 * x", "3 * x"), False),                               # what it computes
    (lambda s: s.replace("not a docstring", "another value"), False),            # a string that is no docstring
    (lambda s: s.replace("import os", "import sys"), False),
    (lambda s: s.replace('"""A module."""', '"""A module."""\nprint(__doc__)'), False),
])
def test_a_modules_fingerprint_is_its_code(tmp_path, edit, same):
    """Comments, layout and docstrings leave the fingerprint (a job's code input) as it is; any change to what the
    module runs changes it."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(MODULE)
    b.write_text(edit(MODULE))
    assert (fingerprint(a) == fingerprint(b)) is same


def test_a_fingerprint_is_the_same_on_every_python(tmp_path):
    """Computed under Python 3.11.7 and 3.12.1 alike (as were those of all fedcore files): a results directory moved to
    another Python reruns nothing for it (``ast.dump`` and ``ast.unparse`` differ there, in an f-string's quotes). A
    new Python that changes it makes this test fail first."""
    path = tmp_path / "m.py"
    path.write_text(MODULE)
    assert fingerprint(path) == "f1150a5ff602ec3abd7b4e8acf746eb73ac455b052d2e19224de9f344b0de8d3"


def test_a_module_reading_docstrings_keeps_them_in_its_fingerprint(tmp_path):
    """A module that reads ``__doc__`` may print it (gpu_check's --help): there a docstring edit is a code edit.
    Reading another module's docstring would make that module's docstrings code too: no fedcore module or workflow
    script does."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(MODULE + "print(__doc__)\n")
    b.write_text(MODULE.replace("A module.", "Reworded.") + "print(__doc__)\n")
    assert fingerprint(a) != fingerprint(b)
    readers = {str(f.relative_to(PACKAGE_DIR)) for f in PACKAGE_DIR.rglob("*.py")
               if "__doc__" in f.read_text() or "getdoc" in f.read_text()}
    assert readers == {"gpu_check.py", "code_inputs.py"}  # its own --help; the rule itself
    assert not [f for f in (PACKAGE_DIR.parent / "workflow" / "scripts").glob("*.py")
                if "__doc__" in f.read_text() or "getdoc" in f.read_text()]


def test_a_fingerprint_file_is_rewritten_only_when_the_code_changes(tmp_path):
    """New, it takes the module's time (outputs newer than the module stay up to date); untouched when it holds the
    fingerprint (Snakemake then sees no newer input); rewritten now on a code edit."""
    src, target = tmp_path / "m.py", tmp_path / "code" / "m.py.sha256"
    src.write_text(MODULE)
    os.utime(src, ns=(5, 5))
    write_fingerprint(src, target, "m.py")
    assert target.stat().st_mtime_ns == 5
    os.utime(target, ns=(1, 1))
    src.write_text(MODULE.replace("Doubles.", "Reworded."))
    write_fingerprint.cache_clear()
    write_fingerprint(src, target, "m.py")
    assert target.stat().st_mtime_ns == 1 and target.read_text().startswith(fingerprint(src))
    src.write_text(MODULE.replace("2 * x", "3 * x"))
    write_fingerprint.cache_clear()
    write_fingerprint(src, target, "m.py")
    assert target.stat().st_mtime_ns > 1 and target.read_text().split()[0] == fingerprint(src)


@pytest.fixture
def fresh_facts(monkeypatch):
    """The module's memo of source facts emptied (and restored after), saved by the test itself; ``_facts`` counted."""
    from fedcore import code_inputs, memo_file

    monkeypatch.setattr(code_inputs, "_FACTS", memo_file.MemoFile(code_inputs._cache_version))
    monkeypatch.setattr(memo_file.atexit, "register", lambda f: None)
    calls = []
    real = code_inputs._facts
    monkeypatch.setattr(code_inputs, "_facts", lambda data, name: calls.append(name) or real(data, name))
    import_graph.cache_clear()
    yield code_inputs, calls
    import_graph.cache_clear()


def _new_process(code_inputs, cache: Path) -> None:
    """What a new `snakemake` call starts from: nothing in memory, the saved facts named."""
    code_inputs._FACTS = type(code_inputs._FACTS)(code_inputs._cache_version)
    import_graph.cache_clear()
    code_inputs.keep_facts_in(cache)


def test_a_later_process_parses_only_the_sources_that_changed(tmp_path, fresh_facts):
    """Saved facts (fingerprints, imports) are reused by their source's bytes: a second call parses nothing, an edited
    file alone is parsed again, and an unreadable cache or one of another version is ignored, never trusted."""
    code_inputs, calls = fresh_facts
    pkg = tmp_path / "fedcore"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""Package."""\n')
    (pkg / "a.py").write_text("from fedcore import b\n\n\ndef f():\n    from .c import g\n    return g\n")
    (pkg / "b.py").write_text(MODULE)
    (pkg / "c.py").write_text("def g():\n    return 1\n")
    cache = tmp_path / "results" / "cache" / "code_facts.json"

    def facts():
        return import_graph(pkg), {p.name: fingerprint(p) for p in sorted(pkg.glob("*.py"))}

    _new_process(code_inputs, cache)
    first = facts()
    assert first[0]["fedcore.a"] == {"fedcore", "fedcore.b", "fedcore.c"}
    assert len(calls) == 4, calls
    code_inputs._FACTS.save()
    assert json.loads(cache.read_text())["version"] == code_inputs._cache_version()

    calls.clear()
    _new_process(code_inputs, cache)
    assert facts() == first and calls == []

    (pkg / "b.py").write_text(MODULE.replace("2 * x", "3 * x"))
    _new_process(code_inputs, cache)
    edited = facts()
    assert calls == [str(pkg / "b.py")] and edited[1]["b.py"] != first[1]["b.py"]
    code_inputs._FACTS.save()
    assert len(json.loads(cache.read_text())["values"]) == 4  # the old b.py's facts dropped

    for bad in ("{", json.dumps({"version": "another", "values": {
            k: {"fingerprint": "0" * 64, "imports": []} for k in json.loads(cache.read_text())["values"]}})):
        cache.write_text(bad)
        calls.clear()
        _new_process(code_inputs, cache)
        assert facts() == edited and len(calls) == 4
