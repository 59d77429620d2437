"""Shared by the scripts of jobs that declare a GPU: take a free one of the machine before CUDA starts."""
import _checkout  # noqa: F401  (first: this checkout's fedcore)
from fedcore.runtime.gpu_slots import claim_for_job


def claim(snakemake) -> None:
    """One GPU of the pool for a job with resource gpu=1 (fedcore/runtime/gpu_slots.py); nothing for the others."""
    claim_for_job(int(getattr(snakemake.resources, "gpu", 0)), str(getattr(snakemake.params, "device", "auto")))
