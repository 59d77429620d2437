"""snakemake -> fedcore.report.aggregate.aggregate_runs."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.aggregate import aggregate_runs  # noqa: E402

_log.setup(snakemake)
aggregate_runs(list(snakemake.input.runs), snakemake.output[0])
