"""snakemake -> fedcore.report.claims_report: one paper's claims checked on the metrics, per scale."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.claims_report import write_paper_claims  # noqa: E402

_log.setup(snakemake)
write_paper_claims(snakemake.wildcards.paper, snakemake.params.claims, snakemake.params.views,
                   snakemake.input.metrics, snakemake.output.csv, snakemake.output.md)
