"""Shared by the thin scripts, imported before any fedcore module: a job runs the fedcore of the checkout whose
Snakefile planned it (the code its code inputs fingerprint). Snakemake puts the Snakefile's directory first on the path
when it reads the workflow, but a script job only appends it, after site-packages and PYTHONPATH: a non-editable
install, a compat-mode editable install of another clone or PYTHONPATH would win there, and the job would silently
run that code (tests/test_job_checkout.py)."""
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # workflow/scripts/_checkout.py -> the checkout
if (CHECKOUT / "fedcore" / "__init__.py").is_file():
    if "fedcore" in sys.modules and Path(sys.modules["fedcore"].__file__).resolve().parent != CHECKOUT / "fedcore":
        raise SystemExit(f"this job must run {CHECKOUT / 'fedcore'}, but fedcore was already imported from "
                         f"{sys.modules['fedcore'].__file__}")
    sys.path.insert(0, str(CHECKOUT))
