"""snakemake -> fedcore.data.registry.build_dataset."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.data.registry import build_dataset, load_checksums  # noqa: E402

_log.setup(snakemake)
# read from the config, not params: a params entry would rebuild every dataset (and rerun every run) once
build_dataset(snakemake.wildcards.dataset, Path(snakemake.output[0]), Path(snakemake.params.resources),
              load_checksums(snakemake.params.checksums),
              allow_folder_layout=bool(snakemake.config.get("allow_folder_layout", False)))
