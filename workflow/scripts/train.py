"""snakemake -> fedcore.train.train_run."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir)))
import _gpu  # noqa: E402
import _log  # noqa: E402

p = snakemake.params
_log.setup(snakemake, history=p.log_history)
_gpu.claim(snakemake)  # before CUDA starts: one free GPU of the machine for a gpu=1 job
from fedcore.train import train_run  # noqa: E402

artifacts = {k.removeprefix("artifact_"): v for k, v in snakemake.input.items() if k.startswith("artifact_")}
extra = {k.removeprefix("extra_dataset_"): v for k, v in snakemake.input.items() if k.startswith("extra_dataset_")}
backbone = getattr(snakemake.input, "backbone", None)  # absent: the method builds its own (pFedPT)
train_run(p.cfg, p.identity, snakemake.input.dataset, snakemake.input.partition, p.arch, backbone,
          snakemake.output.metrics, snakemake.output.final, checkpoint_path=p.checkpoint, device=p.device,
          threads=p.threads, artifacts=artifacts, depends_on=snakemake.input.code,
          extra_datasets=extra, backbone_sha256=p.sha256 if backbone is not None else None, compile=p.compile,
          deterministic=p.deterministic)
