"""GPU path (skipped without CUDA): device-resident data, bf16 autocast, the same numbers' shape as on CPU."""
from __future__ import annotations

import pytest
import torch

from conftest import identity, run_params
from fedcore.report.aggregate import validate_metrics
from fedcore.train import train_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("method", ["fedvpt", "head_tune", "local"])
def test_training_runs_on_cuda(tiny_run_files, tmp_path, method):
    cpu = train_run(run_params(rounds=3), identity(method), tiny_run_files["dataset"], tiny_run_files["partition"],
                    "vit_mini", tiny_run_files["weights"], tmp_path / "c.parquet", tmp_path / "c.pt",
                    device="cpu", progress=False).metrics
    gpu = train_run(run_params(rounds=3), identity(method), tiny_run_files["dataset"], tiny_run_files["partition"],
                    "vit_mini", tiny_run_files["weights"], tmp_path / "g.parquet", tmp_path / "g.pt",
                    device="cuda", progress=False)
    validate_metrics(gpu.metrics, "gpu run")
    assert all(t.is_cuda for t in gpu.global_state.values())
    sel = "client == -1 and split == 'global' and metric == 'acc'"
    # bf16 autocast changes the trajectory a little, not the outcome
    assert abs(cpu.query(sel)["value"].iloc[-1] - gpu.metrics.query(sel)["value"].iloc[-1]) < 0.15
