"""snakemake -> fedcore.report.html_pages.figure_page: a figure as a report item, its caption under it."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.html_pages import figure_page  # noqa: E402

_log.setup(snakemake)
p = snakemake.params
figure_page(snakemake.input.png, snakemake.output[0], p.title, p.caption, p.scale)
