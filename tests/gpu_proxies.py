"""The GPU proxies run on one method: two rounds under CUDA's rules on the CPU, then its server side on a second
device (tests/test_gpu_proxies_*.py parametrise it over every method and variant)."""
from __future__ import annotations

from pathlib import Path

import pytest

from every_method import methods_of, recorded, replay_server_side, representative_runs, tiny_run
from fedcore.engine.precision import cuda_rules_on_cpu
from fedcore.report.aggregate import validate_metrics


def runs_of(*papers: str) -> list:
    """pytest params (experiment, method) of the representative runs of ``papers``, with the method as id."""
    names = {m for p in papers for m in methods_of(p)}
    return [pytest.param(e, m, id=m) for e, m in representative_runs() if m in names]


def check_under_gpu_rules(experiment: str, method: str, root: Path, out: Path, monkeypatch) -> None:
    """(a) two rounds under CUDA's rules on the CPU (bf16 autocast, bf16 where CUDA's autocast casts, CUDA's choice
    of paths, the batched path where a method offers one): the dtype class of GPU-only bugs; (b) the recorded
    server side replayed on a second device: the device class."""
    rec = recorded(monkeypatch)
    run = tiny_run(experiment, method, root)
    with cuda_rules_on_cpu():
        result = run.train(out, batched=True)
    validate_metrics(result.metrics, f"{method} under CUDA's rules")
    replay_server_side(rec.last)
