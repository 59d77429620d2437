"""snakemake -> fedcore.report.figures."""
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.figures import plot_accuracy_per_round  # noqa: E402

_log.setup(snakemake)
plot_accuracy_per_round(pd.read_parquet(snakemake.input[0]), snakemake.params.figure, snakemake.output.png,
                        snakemake.output.pdf, scale=snakemake.params.scale, experiments=snakemake.params.experiments)
