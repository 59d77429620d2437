"""snakemake -> fedcore.report.render.render_table (the table's kind picks the builder)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.render import render_table  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
render_table(p.table, dict(snakemake.input.items()), snakemake.output.md, snakemake.output.tex,
             snakemake.output.csv, {"scale": p.scale, "experiments": p.experiments, "implemented": p.implemented,
                                         "eval_sets": p.eval_sets},
             out_html=snakemake.output.html)
