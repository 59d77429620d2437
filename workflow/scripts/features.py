"""snakemake -> fedcore.artifacts.build_artifact."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.artifacts import build_artifact  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
build_artifact(snakemake.wildcards.artifact, snakemake.input.dataset, p.arch, snakemake.input.backbone,
               snakemake.output[0], device=p.device, threads=p.threads)
