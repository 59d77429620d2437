"""snakemake -> fedcore.data.registry.fetch_raw; writes the verified-files stamp."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.data.registry import fetch_raw, load_checksums  # noqa: E402
from fedcore.io import atomic_write_text  # noqa: E402

_log.setup(snakemake)
files = fetch_raw(snakemake.wildcards.dataset, Path(snakemake.params.resources), load_checksums(snakemake.params.checksums))
atomic_write_text(snakemake.output[0], json.dumps({"dataset": snakemake.wildcards.dataset,
                                                   "files": [str(f) for f in files]}, indent=2))
