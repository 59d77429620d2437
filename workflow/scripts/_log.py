"""Shared by the thin scripts: send logging and warnings of one job to its Snakemake log file."""
import logging
import sys


def setup(snakemake) -> None:
    """Route logging and stderr (progress bars included) to the job's log."""
    if snakemake.log:
        fh = open(snakemake.log[0], "a", buffering=1)
        sys.stderr = fh
        logging.basicConfig(stream=fh, level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                            force=True)
