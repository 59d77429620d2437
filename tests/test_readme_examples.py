"""README's "Adding an experiment" example is a complete one: pasted into a copy of the config, it loads at every
scale and plans exactly its runs for its table."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from fedcore.config import load_config
from fedcore.plan import plan_run

ROOT = Path(__file__).resolve().parents[1]


def _example() -> tuple[dict, dict]:
    """The README's experiment and table, as the two YAML mappings they are pasted into."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Adding an experiment", 1)[1].split("\n### ", 1)[0]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    doc = yaml.safe_load(block)
    experiments = {k: v for k, v in doc.items() if "dataset" in v}
    tables = {k: v for k, v in doc.items() if "columns" in v}
    assert len(experiments) == 1 and len(tables) == 1 and len(doc) == 2
    return experiments, tables


def test_the_readme_experiment_and_table_load_and_plan_their_runs(tmp_path):
    experiments, tables = _example()
    shutil.copytree(ROOT / "config", tmp_path / "config")
    for kind, entries in (("experiments", experiments), ("reports", tables)):
        path = tmp_path / "config" / kind / "sgpt.yaml"
        doc = yaml.safe_load(path.read_text())
        doc["experiments" if kind == "experiments" else "tables"].update(entries)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    (name, exp), table = next(iter(experiments.items())), next(iter(tables))
    top = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    for scale in ("mini", "paper"):
        cfg = load_config({**top, "scale": scale, "outputs": [table]}, tmp_path)
        runs = {(r["experiment"], r["method"]) for r in cfg.runs()}
        assert runs == {(name, m) for m in exp["methods"]}
        plan = plan_run(cfg, name, "sgpt", 0)
        assert plan.identity["experiment"] == name and plan.params["federation"]["local_epochs"] >= 1


def test_python_m_fedcore_plan_prints_a_runs_settings_after_every_layer(capsys):
    """config/README.md's example: FedHPL's FedAvg trains its own 20 rounds at mini, 100 at paper."""
    from fedcore.plan import main

    for scale, rounds in (("mini", 20), ("paper", 100)):
        assert main(["hpl_c10_iid_homo", "fedavg", "--scale", scale, "--root", str(ROOT)]) == 0
        doc = yaml.safe_load(capsys.readouterr().out)
        assert doc["identity"]["scale"] == scale and doc["params"]["federation"]["rounds"] == rounds
    assert main(["hpl_c10_a0p1_homo", "hpl_tc2", "--scale", "mini", "--root", str(ROOT)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["params"]["federation"]["local_epochs"] == 2  # its own setting


def test_the_plan_shows_the_method_params_the_run_trains_with(capsys):
    """The job's params hold what the config sets (FedEM at mini: nothing); the plan also prints them with the
    method's defaults filled in, as the method runs."""
    from fedcore.methods import method_class
    from fedcore.plan import main

    assert main(["sgpt_c100_s50", "fedem", "--scale", "mini", "--root", str(ROOT)]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["params"]["method_params"] == {}
    assert doc["method_params_with_defaults"] == method_class("fedem").defaults != {}
