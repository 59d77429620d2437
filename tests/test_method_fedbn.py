"""FedBN: every BatchNorm layer (affine parameters and running statistics) stays with its client, everything
else (convolutions, head) is averaged; the split is found by module type on any ResNet."""
from __future__ import annotations

import math

import pandas as pd
import torch

from conftest import scratch_run
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.roles import Client
from fedcore.methods.fedbn import FedBN, FedBNClient

BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _method(arch: str) -> FedBN:
    torch.manual_seed(0)
    return FedBN(prompt_adapter(build_backbone(arch)), 4)


def test_batchnorm_layers_of_resnet8_pft_are_personal_by_hand():
    method = _method("resnet8_pft_mini")
    keys = method.keys(0)
    # stem BN, two BNs in each of the three one-block stages, the downsample BN of stages 2 and 3
    layers = ["net.bn1"] + [f"net.layer{s}.0.bn{i}" for s in (1, 2, 3) for i in (1, 2)] + \
             [f"net.layer{s}.0.downsample.1" for s in (2, 3)]
    expected = {f"{layer}.{k}" for layer in layers for k in BN_KEYS}
    personal = method.client.personal_keys(keys)
    assert set(personal) == expected and len(personal) == 45
    shared = method.client.shared_keys(keys)
    assert set(shared) | set(personal) == set(keys) and not set(shared) & set(personal)
    assert {"net.conv1.weight", "net.layer2.0.downsample.0.weight", "head.weight", "head.bias"} <= set(shared)


def test_the_split_goes_by_module_type_on_another_resnet():
    method = _method("resnet_mini_18")
    keys = method.keys(0)
    personal = method.client.personal_keys(keys)
    modules = dict(method.model.named_modules())
    assert personal and all(isinstance(modules[k.rpartition(".")[0]], torch.nn.BatchNorm2d) for k in personal)
    assert all(not isinstance(modules.get(k.rpartition(".")[0]), torch.nn.BatchNorm2d)
               for k in method.client.shared_keys(keys))


def test_run_keeps_batchnorm_apart_averages_the_rest_and_matches_one_by_one(pft_files, tmp_path, monkeypatch):
    together = scratch_run(pft_files, tmp_path / "together", "fedbn")
    assert all(math.isfinite(v) for v in together.metrics["value"])
    assert not any("bn" in k or "downsample.1" in k for k in together.global_state)
    assert "net.conv1.weight" in together.global_state and "head.weight" in together.global_state
    stats = torch.stack([together.personal_states[c]["net.bn1.running_mean"] for c in range(4)])
    assert (stats - stats[0]).abs().amax(dim=1)[1:].min() > 1e-4       # each client's own statistics
    # one round: together and one by one agree up to float reassociation inside vmap, which later rounds of
    # from-scratch training amplify (1e-6 after one round, 5e-5 after two)
    together = scratch_run(pft_files, tmp_path / "together1", "fedbn", rounds=1)
    monkeypatch.setattr(FedBNClient, "together", Client.together)
    alone = scratch_run(pft_files, tmp_path / "alone", "fedbn", rounds=1)
    acc = lambda r: r.metrics[r.metrics.metric.str.startswith("acc")].reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(acc(together), acc(alone), atol=1e-5, rtol=0)
    for c in range(4):
        for k, v in together.personal_states[c].items():
            assert torch.allclose(v.float(), alone.personal_states[c][k].float(), atol=1e-5), (c, k)
