"""snakemake -> fedcore.analysis.run_features.write_attention (FedPFT Fig. 6)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _gpu  # noqa: E402
import _log  # noqa: E402

import torch  # noqa: E402

_log.setup(snakemake)
_gpu.claim(snakemake)  # before CUDA starts: one free GPU of the machine for a gpu=1 job
from fedcore.analysis.run_features import write_attention  # noqa: E402

p = snakemake.params
torch.set_num_threads(p.threads)
write_attention(p.panels, int(p.figure.get("client", 0)), int(p.figure.get("samples", 20)), snakemake.output[0],
                device=p.device)
