"""Config validation: errors name the key and the allowed values, before any work is done."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from fedcore.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILE = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
# most checks here need one paper's experiments: SGPT alone loads in a quarter of the four papers' time
DEFAULT = {**DEFAULT_FILE, "papers": ["sgpt"], "outputs": "all"}


def _copy_config(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "config", tmp_path / "config")
    return tmp_path


def test_default_config_runs_every_papers_headline_at_mini():
    cfg = load_config(DEFAULT_FILE, ROOT)
    assert cfg.scale == "mini" and cfg.top["outputs"] == "headline"
    assert {cfg.experiments[r["experiment"]]["paper"] for r in cfg.runs()} == {"sgpt", "fedhpl", "fedotp", "fedpft"}
    assert len(cfg.runs()) < len(cfg.runs(selected_only=False)) / 5


def test_the_paper_registry_is_the_schemas_and_the_config_files():
    """fedcore/papers.py names the papers: the schema allows exactly them, and each has its experiment and report file."""
    from fedcore.papers import PAPERS

    for kind in ("experiments", "reports"):
        assert {p.stem for p in (ROOT / "config" / kind).glob("*.yaml")} == set(PAPERS)
    with pytest.raises(ConfigError, match=r"papers\[0\]: 'fedfoo' is not one of \['sgpt', 'fedhpl', 'fedotp', 'fedpft'\]"):
        load_config({**DEFAULT, "papers": ["fedfoo"]}, ROOT)


def test_sgpt_config_resolves_to_mini_runs():
    cfg = load_config(DEFAULT, ROOT)
    assert cfg.scale == "mini"
    runs = cfg.runs()
    assert {r["experiment"] for r in runs} == {"sgpt_c100_s50", "sgpt_c100_s10", "sgpt_five", "sgpt_office",
                                               "sgpt_domainnet"}, \
        "the experiments of config/experiments/sgpt.yaml, listed here by hand: an added one is added here"
    exp = cfg.experiments["sgpt_c100_s10"]
    assert exp["dataset"] == "digits" and exp["backbone"] == "vit_mini"
    assert exp["partition"]["classes_per_client"] == 2 and exp["federation"]["rounds"] == 10


def test_paper_scale_keeps_paper_budget():
    cfg = load_config({**DEFAULT, "scale": "paper"}, ROOT)
    exp = cfg.experiments["sgpt_c100_s10"]
    assert exp["dataset"] == "cifar100" and exp["backbone"] == "vit_b16_in21k"
    assert exp["federation"] == {"rounds": 60, "participation": 0.05, "local_epochs": 5, "batch_size": 40}
    assert exp["partition"]["clients"] == 100 and exp["partition"]["classes_per_client"] == 10
    assert exp["evaluation"] == {"global_test": "pooled_local", "every": 5}
    assert cfg.train_params("sgpt_c100_s10", "local")["final_window"] == 10


def test_variants_run_their_method_with_merged_params():
    cfg = load_config(DEFAULT, ROOT)
    p = cfg.train_params("sgpt_c100_s10", "sgpt_ak0p3")
    assert p["method"] == "sgpt"
    # the experiment's sgpt params at this scale (mini: 4 blocks), then the variant's
    assert p["method_params"] == {"groups": 5, "shared_blocks": [0], "group_blocks": [1, 2], "select_block": 3,
                                  "key_momentum": 0.3}
    paper = load_config({**DEFAULT, "scale": "paper"}, ROOT)
    assert paper.train_params("sgpt_c100_s10", "sgpt_group_to5")["method_params"] == {
        "groups": 20, "shared_blocks": [0, 1, 2, 3], "group_blocks": [4, 5], "select_block": 11}
    # spec §6: Table 1 24 + Table 2 14 + Table 3 4 + Table 4 4 + Fig. 3 1 + Fig. 4 18 + Figs. 6a/6b 9, and the
    # code-era SGPT beside SGPT in Tables 1 and 2 (3 + 2 runs; audit item 3)
    assert len(paper.runs()) == 79, ("SGPT's paper-scale runs a seed, counted by hand: an experiment, method or "
                                      "variant added to config/experiments/sgpt.yaml changes it; update it here, "
                                      "with the reason, and the README's run counts")


def test_unknown_variant_param_is_reported(tmp_path):
    root = _edit_experiments(tmp_path, lambda d: d["variants"]["sgpt_qg"]["params"].update(key_momentun=0.1))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert "'sgpt_qg' has unknown param(s) ['key_momentun']" in str(e.value) and "key_momentum" in str(e.value)


def test_variant_name_may_not_shadow_a_method(tmp_path):
    root = _edit_experiments(tmp_path, lambda d: d["variants"].update(fedvpt={"method": "sgpt"}))
    with pytest.raises(ConfigError, match="'fedvpt' is already a method or variant"):
        load_config(DEFAULT, root)


def test_train_params_are_one_runs_slice():
    cfg = load_config(DEFAULT, ROOT)
    p = cfg.train_params("sgpt_c100_s10", "fedvpt")
    assert "methods" not in p and "report" not in p  # adding a method to the list reruns no other method
    assert p["final_window"] == 3 and p["method_params"] == {}


@pytest.mark.parametrize("override, needle", [
    ({"scale": "huge"}, "at scale: 'huge' is not one of ['mini', 'paper', 'smoke']"),
    ({"seeds": [0, "one"]}, "at seeds[1]: 'one' is not of type 'integer'"),
    ({"papers": ["sgtp"]}, "at papers[0]: 'sgtp' is not one of ['sgpt', 'fedhpl', 'fedotp', 'fedpft']"),
    ({"sedes": [0]}, "'sedes' was unexpected"),
    ({"device": "tpu"}, "at device: 'tpu' is not one of ['auto', 'cpu', 'cuda']"),
])
def test_top_level_errors_name_key_and_allowed(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config({**DEFAULT, **override}, ROOT)
    assert needle in str(e.value)


def _edit_experiments(tmp_path, edit):
    root = _copy_config(tmp_path)
    path = root / "config" / "experiments" / "sgpt.yaml"
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc))
    return root


def test_unknown_method_names_allowed_methods(tmp_path):
    root = _edit_experiments(tmp_path, lambda d: d["experiments"]["sgpt_five"]["methods"].append("fedavgg"))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    msg = str(e.value)
    assert "experiment sgpt_five" in msg and "methods[9]" in msg and "'fedavgg'" in msg and "'fedvpt_d'" in msg


def test_unknown_experiment_key_lists_allowed_keys(tmp_path):
    root = _edit_experiments(tmp_path, lambda d: d["experiments"]["sgpt_five"].update(lr=0.1))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert "experiments.sgpt_five" in str(e.value) and "'lr' was unexpected" in str(e.value)
    assert "allowed keys" in str(e.value) and "'federation'" in str(e.value)


def test_wrong_type_is_reported(tmp_path):
    root = _edit_experiments(tmp_path, lambda d: d["experiments"]["sgpt_five"]["federation"].update(rounds="ten"))
    with pytest.raises(ConfigError, match=r"federation.rounds: 'ten' is not of type 'integer'"):
        load_config(DEFAULT, root)


def test_unknown_dataset_names_allowed(tmp_path):
    root = _edit_experiments(tmp_path, lambda d: d["experiments"]["sgpt_five"].update(dataset="cifar1000"))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert "at dataset: 'cifar1000' is not one of" in str(e.value) and "'cifar100'" in str(e.value)


def test_bad_partition_key_is_reported(tmp_path):
    root = _edit_experiments(tmp_path, lambda d: d["experiments"]["sgpt_c100_s10"]["partition"].update(alpha=0.1))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert "experiment sgpt_c100_s10 at partition" in str(e.value) and "alpha" in str(e.value)


def test_table_paper_row_length_is_checked(tmp_path):
    root = _copy_config(tmp_path)
    path = root / "config" / "reports" / "sgpt.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["tables"]["sgpt_table1"]["paper"]["sgpt"].pop()
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"paper.sgpt: 8 values for 9 columns"):
        load_config(DEFAULT, root)


def test_scale_dataset_mapping_must_exist(tmp_path):
    root = _copy_config(tmp_path)
    path = root / "config" / "scales" / "mini.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["datasets"]["cifar100"] = "digitz"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"mini.yaml at datasets.cifar100: 'digitz' is not one of"):
        load_config(DEFAULT, root)


def _edit_mini(root: Path, edit) -> None:
    """Apply ``edit`` to SGPT's mini scale file of a copied config."""
    path = root / "config" / "scales" / "mini" / "sgpt.yaml"
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc))


@pytest.mark.parametrize("key, value, allowed", [
    ("select_block", 4, "0..3"),
    ("select_block", 1.0, "a block index 0..3"),
    ("group_blocks", [2, 7], "a list of distinct blocks in 0..3"),
    ("shared_blocks", [-1], "a list of distinct blocks in 0..3"),
    ("shared_blocks", [1, 1], "a list of distinct blocks in 0..3"),   # SGPTModel refused it inside the job
])
def test_block_indices_are_checked_against_the_backbone_depth(tmp_path, key, value, allowed):
    root = _copy_config(tmp_path)
    _edit_mini(root, lambda d: d["experiments"]["sgpt_office"]["method_params"]["sgpt"].update({key: value}))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert (f"mini/sgpt.yaml: experiment 'sgpt_office', method 'sgpt', key '{key}' = {value!r}: allowed {allowed} "
            f"(backbone vit_mini has 4 blocks)") in str(e.value)


def test_a_variants_block_indices_are_checked_too(tmp_path):
    root = _copy_config(tmp_path)  # sgpt_group_to3 puts group prompts on blocks 1..3: fine on 4 blocks ...
    load_config(DEFAULT, root)
    _edit_mini(root, lambda d: d["variants"]["sgpt_group_to3"]["params"].update({"group_blocks": [1, 2, 3, 4]}))
    with pytest.raises(ConfigError, match=r"method 'sgpt_group_to3' \(sgpt\), key 'group_blocks' = \[1, 2, 3, 4\]: "
                                          r"allowed a list of distinct blocks in 0\.\.3"):
        load_config(DEFAULT, root)                 # ... but not on a fifth


def test_client_backbones_resolve_per_client_and_are_checked(tmp_path):
    root = _copy_config(tmp_path)
    exp_file = root / "config" / "experiments" / "sgpt.yaml"
    doc = yaml.safe_load(exp_file.read_text())
    doc["experiments"]["sgpt_office"]["client_backbones"] = ["vit_b16_in21k"] * 4
    exp_file.write_text(yaml.safe_dump(doc))
    cfg = load_config(DEFAULT, root)
    assert cfg.experiments["sgpt_office"]["client_backbones"] == ["vit_mini"] * 4
    assert cfg.train_params("sgpt_office", "fedvpt")["client_backbones"] == [0, 0, 0, 0]
    assert "client_backbones" not in cfg.train_params("sgpt_five", "fedvpt")  # homogeneous runs keep their params
    doc["experiments"]["sgpt_office"]["client_backbones"] = ["vit_b16_in21k"] * 3  # 4 domains, one client each
    exp_file.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"experiment 'sgpt_office', key 'client_backbones' has 3 entries: allowed "
                                          r"one per client \(the partition has 4 clients\)"):
        load_config(DEFAULT, root)
    doc["experiments"]["sgpt_office"]["client_backbones"] = ["vit_b16_in21k", "vit_huge"]
    exp_file.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"client_backbones\[1\]: 'vit_huge' is not one of"):
        load_config(DEFAULT, root)


@pytest.mark.parametrize("key, value, needle", [
    ("groups", 0, "key 'groups' = 0: allowed 1..64 (backbone vit_mini has feature dim 64)"),
    # more orthogonal keys than the embed dim: a bare error in orthogonal_keys, inside the job
    ("groups", 65, "key 'groups' = 65: allowed 1..64 (backbone vit_mini has feature dim 64)"),
    ("groups", "5", "key 'groups' = '5': allowed an integer 1..64 (backbone vit_mini has feature dim 64)"),
    ("key_momentum", 1.5, "key 'key_momentum' = 1.5: allowed [0.0, 1.0]"),
    ("schedule", "bcd2", "key 'schedule' = 'bcd2': allowed one of ['bcd', 'bcd_inv', 'joint']"),
    # digits_five has 5 domains, 2 clients each at mini: Fig. 3's traced client must be one of them
    ("trace_client", 10, "key 'trace_client' = 10: allowed 0..9 (the partition has 10 clients)"),
])
def test_a_methods_declared_constraints_run_when_the_config_loads(tmp_path, key, value, needle):
    """Values the schema accepts but the method cannot run with are refused before any job (not in round 1)."""
    root = _copy_config(tmp_path)
    _edit_mini(root, lambda d: d["experiments"]["sgpt_five"]["method_params"]["sgpt"].update({key: value}))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert f"experiment 'sgpt_five', method 'sgpt', {needle}" in str(e.value)


def test_a_methods_own_check_runs_for_what_rules_cannot_say(tmp_path):
    root = _copy_config(tmp_path)
    _edit_mini(root, lambda d: d["experiments"]["sgpt_five"]["method_params"]["sgpt"].update(
        shared_blocks=[], group_blocks=[]))
    with pytest.raises(ConfigError, match="experiment 'sgpt_five', method 'sgpt': method_params.sgpt: shared_blocks "
                                          "and group_blocks cannot both be empty"):
        load_config(DEFAULT, root)


def test_every_method_param_declares_a_constraint():
    from fedcore.methods import method_class, method_names

    for name in method_names():
        cls = method_class(name)
        missing = sorted(set(cls.defaults) - set(cls.param_rules))
        extra = sorted(set(cls.param_rules) - set(cls.defaults))
        assert not missing and not extra, (
            f"method {name} ({cls.__module__}): every key of `defaults` needs one constraint in `param_rules` "
            f"(fedcore/constraints.py: Int, Number, Choice, Flag, BlockIndex, BlockList); without a rule: {missing}, "
            f"rules for no default: {extra}")


@pytest.mark.parametrize("experiment, partition, needle", [
    ("sgpt_c100_s10", {"classes_per_client": 12},
     "key 'partition.classes_per_client' = 12: allowed 1..10 (dataset digits has 10 classes)"),
    ("sgpt_c100_s10", {"clients": 7},
     "key 'partition.clients' = 7: allowed multiples of 5 (clients * classes_per_client (2) must be a multiple of "
     "the 10 classes of dataset digits)"),
    # each class goes to clients*2/10 clients: beyond 20, a share of a 30-image test class can be empty
    ("sgpt_c100_s10", {"clients": 1000},
     "key 'partition.clients' = 1000: allowed 5..100 in steps of 5 (with classes_per_client 2, each of the 10 "
     "classes of dataset digits is shared by clients * 2 / 10 clients; beyond 20 the smallest class (30 test "
     "samples) can leave a client's share empty)"),
    ("sgpt_five", {"clients_per_domain": 100},
     "key 'partition.clients_per_domain' = 100: allowed 1..63 (the smallest domain of dataset digits_five has "
     "63 test samples)"),
    ("sgpt_domainnet", {"train_fraction_of_min": 0.005},
     "key 'partition.train_fraction_of_min' = 0.005: allowed [0.006369, 1] (every client keeps "
     "int(fraction * 157) train samples"),
])
def test_a_partition_the_dataset_cannot_fill_is_refused(tmp_path, experiment, partition, needle):
    """Checked from the dataset's static facts (fedcore/data/facts.py): nothing is built."""
    root = _copy_config(tmp_path)
    _edit_mini(root, lambda d: d["experiments"][experiment]["partition"].update(partition))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert f"mini/sgpt.yaml: experiment {experiment!r}, {needle}" in str(e.value)


def test_a_domain_partition_needs_a_dataset_with_domains(tmp_path):
    root = _copy_config(tmp_path)
    _edit_mini(root, lambda d: d.setdefault("datasets", {}).update(five_dataset="digits"))
    with pytest.raises(ConfigError, match=r"experiment 'sgpt_five', key 'partition.scheme' = 'domain': allowed a "
                                          r"scheme without domains \(dataset digits has no domain labels\)"):
        load_config(DEFAULT, root)


def test_every_experiment_file_is_checked_at_every_scale(tmp_path):
    """mini overrides sgpt_c100_s10's methods and SGPT params; the file's own values are still checked (at paper
    scale), whatever scale runs."""
    root = _edit_experiments(tmp_path, lambda d: d["experiments"]["sgpt_c100_s10"]["methods"].append("fedavgg"))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert "paper.yaml" in str(e.value) and "methods[43]: 'fedavgg' is not one of" in str(e.value)
    root = _edit_experiments(tmp_path / "b", lambda d: d["experiments"]["sgpt_c100_s10"]["method_params"]["sgpt"]
                             .update(select_block=12))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert ("paper.yaml: experiment 'sgpt_c100_s10', method 'sgpt', key 'select_block' = 12: allowed 0..11 "
            "(backbone vit_b16_in21k has 12 blocks)") in str(e.value)


def test_command_line_values_are_checked_as_a_config_files_are():
    """Snakemake reads `--config seeds=[-1]` as ['-1']: the message is the config file's, not the string's."""
    from snakemake.cli import parse_config

    cli = parse_config(["seeds=[-1]"])
    assert cli == {"seeds": ["-1"]}
    for given in (cli, {"seeds": [-1]}):
        with pytest.raises(ConfigError, match=r"at seeds\[0\]: -1 is less than the minimum of 0"):
            load_config({**DEFAULT, **given}, ROOT)
    assert load_config({**DEFAULT, **parse_config(["seeds=[2,0]"])}, ROOT).seeds == [2, 0]


def test_results_must_be_a_directory_this_user_may_write(tmp_path, monkeypatch):
    """`--config results=<a file>` used to end in a Snakemake traceback (NotADirectoryError); one in a directory the
    user may not write, in the first job's or fingerprint's PermissionError."""
    from snakemake.cli import parse_config

    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for value in (str(a_file), str(a_file / "sub")):
        with pytest.raises(ConfigError, match=r"at results: .* must be a directory \(created if missing\), but "
                                              rf"'{a_file}' is a file"):
            load_config({**DEFAULT, **parse_config([f"results={value}"])}, ROOT)
    assert load_config({**DEFAULT, "results": str(tmp_path / "new" / "results")}, ROOT).top["results"]
    locked = tmp_path / "locked"   # a directory this user may not write in (root may write anywhere: pretend)
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    for value in (str(locked), str(locked / "new" / "results")):
        with pytest.raises(ConfigError, match=rf"at results: '{value}' cannot be written: this user may not "
                                              rf"write in '{locked}'"):
            load_config({**DEFAULT, **parse_config([f"results={value}"])}, ROOT)
    # a site's read-only copy of the datasets and weights is a valid `resources`
    assert load_config({**DEFAULT, "resources": str(locked)}, ROOT).top["resources"] == str(locked)


def test_an_experiments_augment_reaches_every_method_of_it_and_no_other_run(tmp_path):
    """FedPFT spec §8 A21: the base augmentation is the experiment's, the same for FedAvg and FedPFT; experiments
    without one (every SGPT run) keep their params; an unknown name is refused when the config loads."""
    cfg = load_config({**DEFAULT, "papers": ["sgpt", "fedpft"]}, ROOT)
    assert cfg.train_params("pft_c100_dir0p1", "fedavg")["augment"] == ["crop_flip", "rotate15"]
    assert cfg.train_params("pft_c100_dir0p1", "fedpft")["augment"] == ["crop_flip", "rotate15"]
    assert "augment" not in cfg.train_params("pft_c10_dir0p1", "fedavg")
    assert "augment" not in cfg.train_params("sgpt_five", "sgpt")
    root = _copy_config(tmp_path)
    path = root / "config" / "experiments" / "fedpft.yaml"
    path.write_text(path.read_text().replace("augment: [flip, rotate15]", "augment: [flip, rotate_15]", 1))
    with pytest.raises(ConfigError, match=r"experiment 'pft_tiny_dir0p1', key 'augment': unknown augmentation\(s\) "
                                          r"\['rotate_15'\]"):
        load_config({**DEFAULT, "papers": ["fedpft"]}, root)


def test_a_missing_learning_rate_is_an_error_not_a_default(tmp_path):
    """lr sets a run's numbers: without it the config is refused (it once became 0.01 silently)."""
    root = _edit_experiments(tmp_path, lambda d: d["experiments"]["sgpt_five"]["optimizer"].pop("lr"))
    with pytest.raises(ConfigError, match=r"experiment sgpt_five: optimizer is missing \['lr'\]"):
        load_config(DEFAULT, root)


@pytest.mark.parametrize("scale", ["mini", "paper", "smoke"])
def test_every_configured_run_is_read_by_some_table_or_figure(scale):
    """A run no output reads costs compute and shows nowhere (FedHPL's hpl_bs32 and the CIFAR-100/SVHN Local runs
    were such runs): every (experiment, method) a scale configures is read by some table, figure or probe."""
    from fedcore.selection import output_runs

    cfg = load_config({**DEFAULT_FILE, "scale": scale, "outputs": "all"}, ROOT)    # all four papers
    configured = {(e, m) for e, x in cfg.experiments.items() for m in x["methods"]}
    read = set().union(*[output_runs(n, cfg.tables, cfg.figures, cfg.experiments)
                         for n in list(cfg.tables) + list(cfg.figures)])
    unread = sorted(configured - read)
    assert configured and not unread, (
        f"at scale {scale}, no table, figure or probe reads these (experiment, method) runs, so no `outputs` choice "
        f"trains them: {unread}. Add each to a table's `rows:` or a figure of config/reports/<paper>.yaml "
        "(README, Adding a method), or drop it from the experiment's `methods:`")


def test_a_best_window_needs_every_round_evaluated(tmp_path):
    """FedPFT reports its best round: with evaluation every 5th round the 'best' would be the best of a fifth."""
    root = _copy_config(tmp_path)
    path = root / "config" / "experiments" / "sgpt.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["experiments"]["sgpt_c100_s10"]["report"] = {"window": "best"}
    doc["experiments"]["sgpt_c100_s10"]["evaluation"] = {**doc["experiments"]["sgpt_c100_s10"].get("evaluation", {}),
                                                         "every": 5}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"sgpt_c100_s10: report.window 'best' needs every round evaluated"):
        load_config(DEFAULT, root)
