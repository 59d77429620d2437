"""snakemake -> fedcore.backbones.standin.save_random_weights."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.backbones.standin import save_random_weights  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
save_random_weights(p.arch, p.tag, snakemake.output[0], replaces=p.replaces)
