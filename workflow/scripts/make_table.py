"""snakemake -> fedcore.report.tables."""
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.tables import build_table, write_table  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
table = build_table(pd.read_parquet(snakemake.input[0]), p.table, p.experiments, p.scale, set(p.implemented))
write_table(table, p.table, p.scale, snakemake.output.md, snakemake.output.tex, snakemake.output.csv)
