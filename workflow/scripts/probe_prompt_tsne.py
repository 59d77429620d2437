"""snakemake -> fedcore.analysis.tsne.prompt_tsne (FedOTP Fig. A5)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

import torch  # noqa: E402

from fedcore.analysis.tsne import prompt_tsne  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
torch.set_num_threads(p.threads)
prompt_tsne(snakemake.input.final, snakemake.input.dataset, snakemake.input.partition, p.figure, snakemake.output[0])
