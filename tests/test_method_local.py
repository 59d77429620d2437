"""Local with ``representation: backbone`` (FedPFT's Local): every client trains its own entire model, BatchNorm
statistics included, every round, sends nothing and is scored with its own model."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from conftest import scratch_run
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.methods.local import Local


@pytest.mark.parametrize("arch", ["resnet8_pft_mini", "resnet_mini_18"])
def test_the_entire_model_is_personal_and_nothing_is_sent(arch):
    torch.manual_seed(0)
    method = Local(prompt_adapter(build_backbone(arch)), 4, {"representation": "backbone"})
    keys = method.keys(0)
    assert {"net.conv1.weight", "net.bn1.running_mean", "head.weight"} <= set(keys)
    assert method.client.personal_keys(keys) == keys and method.client.shared_keys(keys) == []
    assert all(p.requires_grad for p in method.model.parameters())


def test_prompt_only_params_are_refused_with_prompts():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="init and common_dim apply to representation: backbone only"):
        Local(prompt_adapter(build_backbone("vit_mini")), 4, {"init": "random"})


def test_every_client_trains_every_round_alone_and_resumes_exactly(pft_files, tmp_path):
    full = scratch_run(pft_files, tmp_path / "full", "local", participation=0.5, representation="backbone")
    m = full.metrics
    assert all(math.isfinite(v) for v in m["value"])
    trained = m[(m.split == "train") & (m.metric == "loss") & (m.client >= 0)]
    assert sorted(trained.groupby("round").client.apply(sorted).tolist()) == [[0, 1, 2, 3]] * 2  # all, each round
    assert (m[m.metric == "upload_numbers"]["value"] == 0).all() and full.global_state == {}
    states = full.personal_states
    assert set(states) == {0, 1, 2, 3} and "net.bn1.running_mean" in states[0]
    assert int(states[0]["net.bn1.num_batches_tracked"]) == 2 * 3      # 2 rounds x 3 batches of 16 (40 samples)
    conv = torch.stack([states[c]["net.conv1.weight"] for c in range(4)])
    assert (conv - conv[0]).abs().amax(dim=(1, 2, 3, 4))[1:].min() > 0  # four different models
    assert scratch_run(pft_files, tmp_path / "cut", "local", stop=1, participation=0.5,
                       representation="backbone") is None
    resumed = scratch_run(pft_files, tmp_path / "cut", "local", participation=0.5, representation="backbone")
    pd.testing.assert_frame_equal(full.metrics, resumed.metrics)
