"""snakemake -> fedcore.data.registry.check_data; fails listing every problem."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.data.registry import check_data, load_checksums  # noqa: E402

_log.setup(snakemake)
problems = check_data(snakemake.params.datasets, Path(snakemake.params.resources), load_checksums(snakemake.params.checksums))
problems += [f"backbone weight file {w} is missing (see config/backbones.yaml for its source)"
             for w in snakemake.params.weights if not Path(w).is_file()]
if problems:
    raise SystemExit("check_data found problems:\n  " + "\n  ".join(problems))
