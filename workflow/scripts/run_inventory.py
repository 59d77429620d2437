"""snakemake -> fedcore.report.inventory.write_inventory (a paper's run inventory page and CSV)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.inventory import write_inventory  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
tables = snakemake.input.tables
tables = {Path(t).stem: t for t in ([tables] if isinstance(tables, str) else tables)}
write_inventory(snakemake.input.metrics, p.runs, tables, snakemake.wildcards.paper, p.scale, snakemake.output.html,
                snakemake.output.csv, p.labels, p.unbuilt)
