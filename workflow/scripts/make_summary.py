"""snakemake -> fedcore.report.summary.write_summary (the report's landing page)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.summary import Context, PaperInputs, write_summary  # noqa: E402

_log.setup(snakemake)
p, i = snakemake.params, snakemake.input
inputs = [PaperInputs(x["paper"], c, s, r, x["times"], x["data"], x["unbuilt"])
          for x, c, s, r in zip(p.papers, i.claims, i.scorecards, i.inventories, strict=True)]
write_summary(inputs, Context(p.scale, list(p.seeds), p.outputs), p.results, snakemake.output.md,
              snakemake.output.csv, snakemake.output.html, snakemake.output.landing)
