"""snakemake -> fedcore.partition.make: partition file, per-client class counts, heatmap."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.data.arrays import load_bundle  # noqa: E402
from fedcore.io import atomic_path  # noqa: E402
from fedcore.partition.make import class_counts, make_partition  # noqa: E402
from fedcore.partition.plots import plot_class_heatmap  # noqa: E402

_log.setup(snakemake)
b = load_bundle(snakemake.input[0])
part = make_partition(snakemake.params.spec, int(snakemake.wildcards.seed), b.train.y, b.test.y,
                      b.train.domain, b.test.domain, b.train.coarse, b.test.coarse)
test_y = b.train.y if part.spec.get("test_from") == "train" else b.test.y
counts = class_counts(part, b.train.y, test_y)
with atomic_path(snakemake.output.counts) as tmp:
    counts.to_csv(tmp, index=False)
plot_class_heatmap(counts, snakemake.output.png, snakemake.output.pdf,
                   title=f"{snakemake.wildcards.dataset} {snakemake.wildcards.pid} seed {snakemake.wildcards.seed}")
part.save(snakemake.output.partition)
