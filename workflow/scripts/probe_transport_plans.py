"""snakemake -> fedcore.analysis.transport.compute_transport_plans (FedOTP Fig. A4)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _gpu  # noqa: E402
import _log  # noqa: E402

_log.setup(snakemake)
_gpu.claim(snakemake)  # before CUDA starts: one free GPU of the machine for a gpu=1 job
from fedcore.analysis.transport import compute_transport_plans  # noqa: E402

p = snakemake.params
compute_transport_plans(snakemake.input.dataset, snakemake.input.partition, p.arch, snakemake.input.backbone, p.runs,
                        p.figure, snakemake.output[0], device=p.device, threads=p.threads)
