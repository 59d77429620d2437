"""Load, validate and resolve the pipeline configuration.

Two axes (DESIGN.md): experiments (config/experiments/<paper>.yaml, written at paper scale) and scales
(config/scales/<scale>.yaml, mapping each experiment onto concrete data, backbone and budget), in three layers
(config/README.md). Everything is validated before any job runs; an error names the file, the key and the allowed
values.

    files.py        the files read, merged and schema-validated (imports nothing else of fedcore)
    experiments.py  one experiment mapped onto a scale, and the checks of what its runs can use
    reports.py      a paper's tables, figures and claims checked; the outputs and runs ``outputs`` picks
    resolved.py     ``Resolved``: the resolved configuration and its per-run views
    load.py         ``load_config``: all of it, at every scale
"""
from fedcore.config.files import ConfigError, check_config_file, deep_merge, read_yaml, validate
from fedcore.config.load import load_config
from fedcore.config.resolved import Resolved, run_backbones

__all__ = ["ConfigError", "Resolved", "check_config_file", "deep_merge", "load_config", "read_yaml", "run_backbones",
           "validate"]
