"""Deterministic kernels on CUDA (fedcore/runtime/determinism.py) and their CPU proxy: a call that CUDA's strict
deterministic mode refuses raises under cuda_rules_on_cpu, so a method that would stop on a GPU stops in CI."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import torch.utils.deterministic

from fedcore.engine.precision import cuda_rules_on_cpu
from fedcore.runtime.determinism import CUBLAS_WORKSPACE_CONFIG, deterministic_kernels, strict_refusal


def _settings() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.benchmark)


def test_a_cuda_job_runs_in_strict_mode_and_the_callers_settings_come_back(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _settings()
    with deterministic_kernels(torch.device("cuda")):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn_only keeps SDPA's atomic backward
        assert torch.backends.cudnn.benchmark is False
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
    assert _settings() == before


def test_a_users_cublas_workspace_is_kept(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_kernels("cuda"):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("device, on", [("cpu", True), ("cuda", False)])
def test_nothing_changes_on_the_cpu_or_when_switched_off(device, on):
    """CPU kernels already are deterministic: CPU numbers stay those of runs made before the switch existed."""
    before = _settings()
    with deterministic_kernels(device, on):
        assert _settings() == before


def _x(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=grad)


REFUSED = [
    ("bilinear resize of a differentiated tensor", lambda: F.interpolate(_x(1, 2, 4, 4), size=6, mode="bilinear")),
    ("grid_sample backward", lambda: F.grid_sample(_x(1, 2, 4, 4), torch.zeros(1, 3, 3, 2), align_corners=False)),
    ("adaptive average pool to 2x2", lambda: F.adaptive_avg_pool2d(_x(1, 2, 4, 4), 2)),
    ("reflection padding backward", lambda: F.pad(_x(1, 2, 4, 4), (1, 1, 1, 1), mode="reflect")),
    ("cross entropy over positions", lambda: F.cross_entropy(_x(2, 3, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long))),
    ("bincount with weights", lambda: torch.bincount(torch.tensor([0, 1, 1]), weights=torch.ones(3))),
    ("histc", lambda: torch.histc(torch.rand(5), bins=3)),
    ("median with indices", lambda: torch.median(torch.rand(3, 4), dim=1)),
    # refused by torch 2.11-2.13 only, which pyproject.toml admits (a GPU site's torch)
    ("cumsum of floats", lambda: torch.cumsum(torch.rand(5), 0)),
    ("cumsum of floats as a method", lambda: torch.rand(5).cumsum(0)),
    ("cumsum of integers into floats", lambda: torch.arange(5).cumsum(0, dtype=torch.float32)),
    ("max_pool3d backward", lambda: torch.nn.MaxPool3d(2)(_x(1, 1, 2, 2, 2))),
]
ALLOWED = [
    ("bilinear resize of images (no gradient)", lambda: F.interpolate(_x(1, 2, 4, 4, grad=False), size=6,
                                                                       mode="bilinear")),
    ("adaptive average pool to 1x1 (a mean)", lambda: F.adaptive_avg_pool2d(_x(1, 2, 4, 4), (1, 1))),
    ("cross entropy of logits", lambda: F.cross_entropy(_x(4, 3), torch.zeros(4, dtype=torch.long))),
    ("bincount of labels", lambda: torch.bincount(torch.tensor([0, 1, 1]), minlength=3)),
    ("median value", lambda: torch.median(torch.rand(5))),
    ("constant padding", lambda: F.pad(_x(1, 2, 4, 4), (1, 1, 1, 1))),
    ("cumsum of integers", lambda: torch.arange(5).cumsum(0)),
    ("max_pool3d without gradient", lambda: F.max_pool3d(_x(1, 1, 2, 2, 2, grad=False), 2)),
]


@pytest.mark.parametrize("what, call", REFUSED, ids=[r[0] for r in REFUSED])
def test_the_proxy_refuses_what_strict_mode_refuses_on_cuda(what, call):
    with cuda_rules_on_cpu(), pytest.raises(RuntimeError, match="has no deterministic CUDA kernel"):
        call()
    call()  # outside the proxy the CPU runs it


@pytest.mark.parametrize("what, call", REFUSED, ids=[r[0] for r in REFUSED])
def test_deterministic_false_lifts_the_refusals(what, call):
    with cuda_rules_on_cpu(deterministic=False):
        call()


@pytest.mark.parametrize("what, call", ALLOWED, ids=[a[0] for a in ALLOWED])
def test_the_proxy_lets_deterministic_calls_through(what, call):
    with cuda_rules_on_cpu():
        call()


def test_a_pool_to_one_is_a_mean_in_torch():
    """Why the 1x1 adaptive pool (ResNets' last pool) is allowed: torch computes it as a mean, whose backward is
    deterministic on CUDA too (the dispatch to mean happens before the device's kernel is chosen)."""
    y = F.adaptive_avg_pool2d(_x(1, 2, 4, 4), (1, 1))
    assert type(y.grad_fn).__name__.startswith("MeanBackward")
    assert strict_refusal(F.adaptive_avg_pool2d, (_x(1, 2, 4, 4), 1), {}) is None


def test_a_method_that_calls_a_refused_op_stops_under_the_proxy(tiny_method_root, tmp_path, monkeypatch):
    """The proxy reaches inside a run (the engine, the one-pass step): a ViT whose features went through a bilinear
    resize before the head would stop on CUDA, and stops here."""
    from every_method import tiny_run
    from fedcore.backbones.prompted import PromptedViT

    forward_tokens = PromptedViT.forward_tokens

    def resize(t):
        return F.interpolate(t[:, None], size=t.shape[1:], mode="bilinear")[:, 0]

    def resized(self, *args, **kwargs):
        out = forward_tokens(self, *args, **kwargs)
        return {b: resize(t) for b, t in out.items()} if isinstance(out, dict) else resize(out)

    monkeypatch.setattr(PromptedViT, "forward_tokens", resized)
    run = tiny_run("sgpt_c100_s50", "fedvpt", tiny_method_root)
    with cuda_rules_on_cpu(), pytest.raises(RuntimeError, match="interpolate's .* has no deterministic CUDA kernel"):
        run.train(tmp_path / "a", batched=True)
    with cuda_rules_on_cpu(deterministic=False):
        run.train(tmp_path / "b", batched=True)
