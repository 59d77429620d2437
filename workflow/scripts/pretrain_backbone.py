"""snakemake -> fedcore.backbones.pretrain.pretrain (supervised: any ViT or ResNet arch of the registry; moco: ViTs)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.backbones.pretrain import pretrain  # noqa: E402
from fedcore.data.arrays import load_bundle  # noqa: E402

_log.setup(snakemake)
stats = pretrain(load_bundle(snakemake.input.dataset), arch=snakemake.params.arch, tag=snakemake.params.tag,
                 seed=0, out_path=snakemake.output[0], threads=snakemake.threads, **snakemake.params.pretrain)
print(stats, file=sys.stderr)
