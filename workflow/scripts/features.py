"""snakemake -> fedcore.artifacts.build_artifact."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _gpu  # noqa: E402
import _log  # noqa: E402

_log.setup(snakemake)
_gpu.claim(snakemake)  # before CUDA starts: one free GPU of the machine for a gpu=1 job
from fedcore.artifacts import build_artifact  # noqa: E402

p = snakemake.params
build_artifact(snakemake.wildcards.artifact, snakemake.input.dataset, p.arch, snakemake.input.backbone,
               snakemake.output[0], device=p.device, threads=p.threads, sha256=p.sha256)
