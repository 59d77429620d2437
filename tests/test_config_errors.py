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
