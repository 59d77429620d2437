"""Shared by the thin scripts: send logging and warnings of one job to its Snakemake log file, and record the job's
own CPU and wall time beside it at exit (fedcore/runtime/jobtime.py; the report's summary sums the training jobs')."""
import _checkout  # noqa: F401  (first: this checkout's fedcore)
import logging
import sys

from fedcore.runtime.jobtime import record_at_exit
from fedcore.runtime.joblog import open_job_log


def setup(snakemake, history=None) -> None:
    """Route logging and stderr (progress bars included) to the job's log; `history` keeps earlier attempts."""
    if snakemake.log:
        fh = open_job_log(snakemake.log[0], history)
        sys.stderr = fh
        logging.basicConfig(stream=fh, level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                            force=True)
        record_at_exit(snakemake.log[0])
