"""snakemake -> fedcore.analysis.linear_probe.write_probe (FedPFT Tables 1, 4, 5, 8: one run's probes)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _gpu  # noqa: E402
import _log  # noqa: E402

import torch  # noqa: E402

_log.setup(snakemake)
_gpu.claim(snakemake)  # before CUDA starts: one free GPU of the machine for a gpu=1 job
from fedcore.analysis.linear_probe import write_probe  # noqa: E402

p = snakemake.params
torch.set_num_threads(p.threads)
write_probe(p.run, snakemake.output[0], snakemake.input.metrics, device=p.device)
