"""snakemake -> fedcore.features.compute_select_queries."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.features import compute_select_queries  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
compute_select_queries(snakemake.input.dataset, p.arch, snakemake.input.backbone, int(snakemake.wildcards.block),
                       snakemake.output[0], device=p.device, threads=p.threads)
