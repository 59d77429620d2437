"""snakemake -> fedcore.report.html_pages.copy_page: a table or report page as a report item of its own."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.html_pages import copy_page  # noqa: E402

_log.setup(snakemake)
copy_page(snakemake.input.page, snakemake.output[0])
