"""A user's mistakes in the config files or on the command line: each is refused when the config loads, by a
ConfigError that names the file, the key and what was expected (not a traceback, and not later inside a job)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedcore.config import ConfigError, load_config
from tests.test_config import DEFAULT, ROOT, _copy_config, _edit_experiments, _edit_mini


def _edit_yaml(path: Path, edit) -> None:
    """Apply ``edit`` to the YAML document at ``path``."""
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc))


@pytest.mark.parametrize("outputs, needle", [
    ("sgpt_table1", "write a list, e.g. [sgpt_table1]"),
    ([], "[] is not valid under any of the given schemas"),
])
def test_outputs_of_the_wrong_shape_says_what_it_may_be(outputs, needle):
    """`--config outputs=sgpt_table1` (one name, not a list): 'not valid under any of the given schemas' said
    neither what outputs may be nor how to write one name."""
    with pytest.raises(ConfigError) as e:
        load_config({**DEFAULT, "outputs": outputs}, ROOT)
    assert "at outputs:" in str(e.value) and needle in str(e.value)
    assert "one of ['headline', 'claims', 'all'] or a non-empty list of str" in str(e.value)


def test_a_single_paper_not_in_a_list_says_how_to_write_it():
    with pytest.raises(ConfigError, match=r"at papers: 'sgpt' is not of type 'array'; write a list, e\.g\. \[sgpt\]"):
        load_config({**DEFAULT, "papers": "sgpt"}, ROOT)


def test_a_yaml_mistake_in_config_yaml_names_the_file_and_line_before_snakemake_reads_it(tmp_path):
    """Snakemake's `configfile:` says only 'Config file is not valid JSON or YAML'; the Snakefile parses the file
    with fedcore first, whose message names the file, the line and the column."""
    from fedcore.config import check_config_file

    path = tmp_path / "config.yaml"
    path.write_text("scale: mini\nseeds:\t[0]\n")
    with pytest.raises(ConfigError, match=rf"(?s)config file {path} is not valid YAML: .*line 2, column 7"):
        check_config_file(path)
    check_config_file(tmp_path / "absent.yaml")  # a --configfile run may have none: Snakemake decides then
    snakefile = (ROOT / "Snakefile").read_text()
    assert 0 <= snakefile.find('check_config_file(Path("config/config.yaml"))') < snakefile.find("configfile:")


def test_a_partition_error_names_the_experiment_file_and_the_scale(tmp_path):
    """mini overrides sgpt_c100_s50's clients, so clients: 0 fails at paper scale: the message said only
    'config error in experiment sgpt_c100_s50 at partition', not where the value was written."""
    root = _edit_experiments(tmp_path, lambda d: d["experiments"]["sgpt_c100_s50"]["partition"].update(clients=0))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    msg = str(e.value)
    assert f"config error in {root / 'config/experiments/sgpt.yaml'} after {root / 'config/scales/paper.yaml'}" in msg
    assert "experiment sgpt_c100_s50 at partition: partition key 'clients' must be an integer >= 1, got 0" in msg


def test_a_scale_overrides_partition_error_names_the_scale_file(tmp_path):
    root = _copy_config(tmp_path)
    _edit_mini(root, lambda d: d["experiments"]["sgpt_five"]["partition"].update(clients_per_domain="two"))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert f"after {root / 'config/scales/mini/sgpt.yaml'}: experiment sgpt_five at partition" in str(e.value)


def test_a_report_window_longer_than_the_rounds_names_the_files(tmp_path):
    root = _edit_experiments(tmp_path, lambda d: d["experiments"]["sgpt_c100_s50"]["report"].update(rounds=100))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert (f"config error in {root / 'config/experiments/sgpt.yaml'} after {root / 'config/scales/paper.yaml'}: "
            "experiment sgpt_c100_s50: report.rounds=100 exceeds federation.rounds=60") in str(e.value)


@pytest.mark.parametrize("folder, section, name, word", [("experiments", "experiments", "sgpt_office", "experiment"),
                                                         ("reports", "tables", "sgpt_table5", "table")])
def test_a_name_used_twice_across_papers_names_both_files(tmp_path, folder, section, name, word):
    """Runs, tables and their files are keyed by the name alone: a name SGPT's file defines, written again in
    FedOTP's, is refused naming both files (the message named only the second)."""
    root = _copy_config(tmp_path)
    entry = yaml.safe_load((root / f"config/{folder}/sgpt.yaml").read_text())[section][name]
    _edit_yaml(root / f"config/{folder}/fedotp.yaml", lambda d: d[section].update({name: entry}))
    with pytest.raises(ConfigError) as e:
        load_config({**DEFAULT, "papers": ["sgpt", "fedotp"]}, root)
    assert (f"config error in {root / f'config/{folder}/fedotp.yaml'} at {section}.{name}: the name is already "
            f"a{'n' if word == 'experiment' else ''} {word} of {root / f'config/{folder}/sgpt.yaml'}") in str(e.value)


def test_an_unknown_arch_is_named_not_its_tag(tmp_path):
    """A misspelt arch said 'unknown weight tag 'digits' for arch 'vit_mni'; known tags: []'."""
    root = _copy_config(tmp_path)
    _edit_yaml(root / "config/backbones.yaml", lambda d: d["vit_mini"].update(arch="vit_mni"))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert "backbones.yaml (vit_mini) at arch: 'vit_mni' is not one of [" in str(e.value)
    assert "'vit_mini'" in str(e.value) and "known tags" not in str(e.value)


@pytest.mark.parametrize("key, value", [("sha256", "12345zz"), ("md5", "c58f30108f718f92721af3b95e74349")])
def test_a_malformed_checksum_is_refused_when_the_config_loads(tmp_path, key, value):
    """checksums.yaml was read only by the data jobs: a mistyped digest failed after a download, at paper scale."""
    root = _copy_config(tmp_path)
    _edit_yaml(root / "config/checksums.yaml", lambda d: d["files"][0].update({key: value}))
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert f"config error in {root / 'config/checksums.yaml'}: files[0] (dataset 'cifar10'" in str(e.value)
    digits = {"sha256": 64, "md5": 32}[key]
    assert f"key '{key}' must be null or {digits} hex digits, got {value!r}" in str(e.value)


@pytest.mark.parametrize("column", [{"client": 4}, {"clients": [0, 4]}])
def test_a_client_column_beyond_the_experiments_clients_is_refused(tmp_path, column):
    """sgpt_office has 4 clients (0..3): a column reading client 4 was accepted, and its cell said 'missing
    metric' once every run had trained."""
    root = _copy_config(tmp_path)

    def edit(doc):
        col = doc["tables"]["sgpt_table2"]["columns"][3]
        col.pop("client")
        col.update(column)

    _edit_yaml(root / "config/reports/sgpt.yaml", edit)
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, root)
    assert "sgpt.yaml (table sgpt_table2)" in str(e.value)
    assert ("at columns[3]: client 4 of experiment 'sgpt_office', which has 4 clients (0..3)") in str(e.value)


@pytest.mark.parametrize("args, needle", [
    (["--scale", "papr"], "at scale: 'papr' is not one of ['mini', 'paper', 'smoke']"),
    (["--seed", "-1"], "--seed: -1 is not a seed (an integer >= 0)"),
])
def test_plan_reports_a_bad_argument_as_a_usage_error(capsys, args, needle):
    """`python -m fedcore.plan` printed a traceback for a config error, and planned seed -1."""
    from fedcore.plan import main

    with pytest.raises(SystemExit) as e:
        main(["sgpt_office", "sgpt", "--root", str(ROOT), *args])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_plan_outside_a_checkout_says_where_it_looked(capsys, tmp_path):
    from fedcore.plan import main

    with pytest.raises(SystemExit) as e:
        main(["sgpt_office", "sgpt", "--root", str(tmp_path)])
    assert e.value.code == 2
    assert f"config file {tmp_path / 'config/config.yaml'} does not exist" in capsys.readouterr().err


def test_an_experiment_written_twice_in_one_file_is_refused_with_both_lines(tmp_path):
    """A copied experiment left under its old name replaced the first one silently (YAML keeps the last key), and
    the error, if any, came later from a report naming the lost experiment."""
    root = _copy_config(tmp_path)
    path = root / "config/experiments/sgpt.yaml"
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("  sgpt_office:"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("  ") and not lines[i][2].isspace())
    path.write_text("".join(lines[:end] + lines[start:end] + lines[end:]))  # the block again, just below itself
    with pytest.raises(ConfigError, match=rf"config file {path}: key 'sgpt_office' is written twice in one mapping "
                                          rf"\(lines {start + 1} and {end + 1}\); YAML would keep only the second"):
        load_config(DEFAULT, root)


def test_a_key_a_merge_brings_in_may_be_overridden_but_not_written_twice(tmp_path):
    """`<<: *anchor` then the same key is YAML's way to override (fedotp.yaml, scales/mini/fedpft.yaml use it)."""
    from fedcore.config import check_config_file, read_yaml

    path = tmp_path / "c.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nover: {<<: *b, x: 3}\nlist: [{<<: *b}, {<<: *b, y: 4}]\n")
    assert read_yaml(path) == {"base": {"x": 1, "y": 2}, "over": {"x": 3, "y": 2},
                               "list": [{"x": 1, "y": 2}, {"x": 1, "y": 4}]}
    check_config_file(path)
    path.write_text("top:\n  seeds: [0]\n  scale: mini\n  seeds: [1]\n")
    for read in (read_yaml, check_config_file):  # fedcore's loader and the one Snakemake's configfile: uses
        with pytest.raises(ConfigError, match=r"key 'seeds' is written twice in one mapping \(lines 2 and 4\)"):
            read(path)
