"""snakemake -> fedcore.report.scorecard: one paper's reproduction scorecard from the metrics, per scale."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.scorecard import write_paper_scorecard  # noqa: E402

_log.setup(snakemake)
write_paper_scorecard(snakemake.wildcards.paper, snakemake.params.views, snakemake.input.metrics,
                      snakemake.output.csv, snakemake.output.md)
