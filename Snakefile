# fedprompt-repro: reproduces SGPT, FedHPL, FedOTP and FedPFT end to end.
# `snakemake --cores N` runs the default (mini) scale; `--config scale=paper` the papers' scale; `--config
# scale=smoke` the papers' runs on synthetic data, one round (a check that paper scale runs, not results).
# All logic lives in the fedcore package; rules only wire files together.
from pathlib import Path

from fedcore.config import check_config_file, load_config

check_config_file(Path("config/config.yaml"))  # a YAML mistake named with its line (Snakemake's message has none)
configfile: "config/config.yaml"
report: "workflow/report/workflow.rst"  # the HTML report's front text (snakemake --report results/report.html)

CFG = load_config(config, workflow.basedir)  # validates everything before any job runs
RESULTS = CFG.top["results"]
RESOURCES = CFG.top["resources"]


include: "rules/common.smk"
include: "rules/common_probes.smk"
include: "rules/common_report.smk"
include: "rules/data.smk"
include: "rules/backbones.smk"
include: "rules/partitions.smk"
include: "rules/features.smk"
include: "rules/probes.smk"
include: "rules/probes_runs.smk"
include: "rules/train.smk"
include: "rules/report.smk"
include: "rules/claims.smk"


rule all:
    input:
        f"{RESULTS}/metrics.parquet",
        all_tables(),
        all_figures(),
        all_partition_summaries(),
        all_claim_reports(),
        all_report_pages(),
        all_report_items(),
