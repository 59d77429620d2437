"""snakemake -> fedcore.report.render.render_figure (the figure's kind picks the builder)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.render import render_figure  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
render_figure(p.figure, dict(snakemake.input.items()), snakemake.output.png, snakemake.output.pdf,
              {"scale": p.scale, "experiments": p.experiments, "implemented": p.implemented,
               "personalized": p.personalized, "seed": p.seed})
