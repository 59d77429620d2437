"""snakemake -> fedcore.analysis.congruence.write_congruence (SGPT Fig. 6a)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

import torch  # noqa: E402

from fedcore.analysis.congruence import write_congruence  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
torch.set_num_threads(p.threads)
write_congruence(snakemake.input.queries, snakemake.input.dataset, p.points, p.k, p.seed, snakemake.output[0])
