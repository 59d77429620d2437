"""FedPFT's extractors (spec fedpft §1.2): torchvision's 7x7 stem, BasicBlock stages, trained from scratch; and
backbones drawn at random by each run (`scratch: true`), whose runs need no weight file."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone
from fedcore.backbones.resnet import StemResNet
from fedcore.train import train_run


def _count(model: torch.nn.Module, buffers: bool) -> int:
    n = sum(p.numel() for p in model.parameters())
    if buffers:  # Table 10 counts the running statistics, not the num_batches_tracked counters
        n += sum(b.numel() for k, b in model.named_buffers() if not k.endswith("num_batches_tracked"))
    return n


@pytest.mark.parametrize("arch, params, with_buffers", [("resnet8_pft", 1_232_704, 1_235_392),
                                                         ("resnet10_pft", 4_905_792, 4_911_552)])
def test_trunks_have_the_parameter_counts_of_fedpft_table_10(arch, params, with_buffers):
    net = build_backbone(arch)
    assert _count(net, buffers=False) == params
    assert _count(net, buffers=True) == with_buffers
    assert net.conv1.kernel_size == (7, 7) and isinstance(net.maxpool, torch.nn.MaxPool2d)


@pytest.mark.parametrize("arch, dim, side", [("resnet8_pft", 256, 32), ("resnet10_pft", 512, 64),
                                             ("resnet8_pft_mini", 64, 16), ("resnet10_pft_mini", 128, 16)])
def test_pooled_feature_width_at_cifar_tiny_and_mini_sizes(arch, dim, side):
    net = build_backbone(arch).eval()
    assert net(torch.randn(2, 3, side, side)).shape == (2, dim)
    assert net.num_features == dim


def test_a_three_stage_net_has_no_fourth_stage():
    net = StemResNet((1, 1, 1), (8, 16, 32))
    assert not hasattr(net, "layer4") and net.layer3[0].downsample is not None


def test_stages_and_widths_must_pair_up():
    with pytest.raises(ValueError, match="one depth per stage"):
        StemResNet((1, 1), (8, 16, 32))


def test_a_scratch_backbone_run_draws_its_weights_from_the_seed(tiny_run_files, tmp_path):
    """No weight file: two runs with one seed are identical, another seed differs."""
    params = {**run_params(rounds=1, participation=1.0), "method_params": {"init": "pretrained"}}

    def run(seed: int, name: str):
        out = tmp_path / name
        out.mkdir()
        return train_run(params, identity("fedavg", seed=seed), tiny_run_files["dataset"],
                         tiny_run_files["partition"], "resnet8_pft_mini", None, out / "m.parquet", out / "f.pt",
                         progress=False)

    a, b, c = run(0, "a"), run(0, "b"), run(1, "c")
    key = "net.conv1.weight"
    assert torch.equal(a.server_state["model"][key], b.server_state["model"][key])
    assert not torch.equal(a.server_state["model"][key], c.server_state["model"][key])
    assert np.array_equal(a.metrics["value"].to_numpy(), b.metrics["value"].to_numpy())
