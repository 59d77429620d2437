"""snakemake -> fedcore.analysis.params.write_param_counts (SGPT Table 5)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

import torch  # noqa: E402

from fedcore.analysis.params import write_param_counts  # noqa: E402

_log.setup(snakemake)
torch.set_num_threads(snakemake.params.threads)
write_param_counts(snakemake.params.models, snakemake.output[0])
