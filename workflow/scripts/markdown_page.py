"""snakemake -> fedcore.report.html_pages.write_markdown_page (a Markdown file as a report page)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _log  # noqa: E402

from fedcore.report.html_pages import write_markdown_page  # noqa: E402

_log.setup(snakemake)
write_markdown_page(snakemake.input.md, snakemake.output[0], snakemake.params.title, snakemake.params.toc)
