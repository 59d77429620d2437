"""FedPer: the head stays with each client, the extractor (BatchNorm statistics included) is averaged; clients
train the entire model jointly, together or one by one alike."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from conftest import scratch_run
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.roles import Client, FitResult, RoundInfo
from fedcore.methods.fedper import FedPer, FedPerClient

HEAD = ["head.weight", "head.bias"]


@pytest.mark.parametrize("arch", ["resnet8_pft_mini", "resnet_mini_18"])
def test_head_is_personal_and_the_extractor_with_batchnorm_statistics_is_averaged(arch):
    torch.manual_seed(0)
    method = FedPer(prompt_adapter(build_backbone(arch)), 4)
    keys = method.keys(0)
    assert method.client.personal_keys(keys) == HEAD
    shared = method.client.shared_keys(keys)
    assert shared == [k for k in keys if k not in HEAD]
    assert {"net.conv1.weight", "net.bn1.weight", "net.bn1.running_mean", "net.bn1.num_batches_tracked"} <= set(shared)
    # the server averages by sample count: 1:3 of 1 and 5 is 4, statistics included
    up = [FitResult(c, n, {"model": {k: torch.full_like(v, x) for k, v in method.strategy.init_state(2)["model"].items()
                                     if v.is_floating_point()}}, {}) for c, (x, n) in enumerate(((1.0, 1), (5.0, 3)))]
    server = {"model": {k: v for k, v in method.strategy.init_state(2)["model"].items() if v.is_floating_point()}}
    new = method.strategy.aggregate(RoundInfo(1, 2, 1.0, 0), server, up)["model"]
    assert torch.allclose(new["net.bn1.running_mean"], torch.full_like(new["net.bn1.running_mean"], 4.0))
    assert set(new) <= set(shared)


def test_run_keeps_heads_apart_sends_the_rest_and_matches_one_by_one(pft_files, tmp_path, monkeypatch):
    together = scratch_run(pft_files, tmp_path / "together", "fedper")
    m = together.metrics
    assert all(math.isfinite(v) for v in m["value"])
    assert set(together.global_state) == {k for k in together.global_state if not k.startswith("head.")}
    assert "net.bn1.running_mean" in together.global_state
    heads = torch.stack([together.personal_states[c]["head.weight"] for c in range(4)])
    assert (heads - heads[0]).abs().amax(dim=(1, 2))[1:].min() > 1e-4   # personal, not averaged
    assert set(together.personal_states[0]) == set(HEAD)
    # one round: together and one by one agree up to float reassociation inside vmap, which later rounds of
    # from-scratch training amplify (1e-6 after one round, 5e-5 after two)
    together = scratch_run(pft_files, tmp_path / "together1", "fedper", rounds=1)
    monkeypatch.setattr(FedPerClient, "together", Client.together)
    alone = scratch_run(pft_files, tmp_path / "alone", "fedper", rounds=1)
    acc = lambda r: r.metrics[r.metrics.metric.str.startswith("acc")].reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(acc(together), acc(alone), atol=1e-5, rtol=0)
    for k, v in together.global_state.items():
        assert torch.allclose(v.float(), alone.global_state[k].float(), atol=1e-5), k
