"""ResNet backbones: the tiny MiniResNets, FedHPL's pixel-pad prompt and the frozen PromptedResNet adapter."""
from __future__ import annotations

import pytest
import torch

from fedcore.backbones.pretrain.supervised import pretrain_backbone
from fedcore.backbones.registry import build_backbone
from fedcore.backbones.resnet import MiniResNet, PixelPadPrompt, PromptedResNet, resnet_stages
from tests.test_backbones import _tiny_bundle

torch.set_num_threads(1)


def _x(b: int = 3, s: int = 16, seed: int = 0) -> torch.Tensor:
    """Random model input."""
    return torch.randn(b, 3, s, s, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("size, lr, tb", [(32, 576, 684), (224, 4032, 4140)])
def test_pad_prompt_param_counts(size: int, lr: int, tb: int) -> None:
    # fedhpl spec §1.3 / Table 8: prompt_lr = 2·3·s·w, prompt_tb = 2·3·w·(s+2w), w = 3
    pad = PixelPadPrompt(size)
    assert pad.prompt_lr.numel() == lr and pad.prompt_tb.numel() == tb
    assert sum(p.numel() for p in pad.parameters()) == {32: 1260, 224: 8172}[size]


def test_fedhpl_table8_sums() -> None:
    # head (d·n_c + n_c, CIFAR10) + prompts, in K: ResNet18/34 6.24 / 12.99, ResNet50 21.24 / 27.99
    for dim, k32, k224 in ((512, 6.24, 12.99), (2048, 21.24, 27.99)):
        head = dim * 10 + 10
        assert round((head + sum(p.numel() for p in PixelPadPrompt(32).parameters())) / 1024, 2) == k32
        assert round((head + sum(p.numel() for p in PixelPadPrompt(224).parameters())) / 1024, 2) == k224


def test_pad_prompt_concatenates_around_the_image() -> None:
    pad = PixelPadPrompt(16, width=3, init="normal", generator=torch.Generator().manual_seed(0))
    x = _x()
    out = pad(x)
    assert out.shape == (3, 3, 22, 22)
    torch.testing.assert_close(out[:, :, 3:19, 3:19], x, atol=0, rtol=0)  # no pixel overwritten
    torch.testing.assert_close(out[1, :, 3:19, :3], pad.prompt_lr[0], atol=0, rtol=0)  # left
    torch.testing.assert_close(out[1, :, 3:19, 19:], pad.prompt_lr[1], atol=0, rtol=0)  # right
    torch.testing.assert_close(out[2, :, :3, :], pad.prompt_tb[0], atol=0, rtol=0)  # top spans the new width
    torch.testing.assert_close(out[0, :, 19:, :], pad.prompt_tb[1], atol=0, rtol=0)  # bottom
    assert 0.01 < float(pad.prompt_tb.detach().std()) < 0.03
    zero = PixelPadPrompt(16)
    assert not zero.prompt_lr.any() and not zero.prompt_tb.any()  # default: zero init
    with pytest.raises(ValueError, match="16x16"):
        zero(_x(s=17))


def test_mini_resnets_mirror_torchvision() -> None:
    import torchvision

    tv = torchvision.models.resnet18(weights=None)
    for arch, dim, blocks in (("resnet_mini_18", 128, 4), ("resnet_mini_34", 128, 7), ("resnet_mini_50", 512, 7)):
        m = build_backbone(arch)
        assert isinstance(m, MiniResNet) and m.num_features == dim
        assert sum(len(s) for s in resnet_stages(m)) == blocks
        assert {n.split(".")[0] for n, _ in m.named_children()} == {n for n, _ in tv.named_children()}
        assert m(_x()).shape == (3, dim)
    assert type(build_backbone("resnet_mini_50").layer1[0]).__name__ == "Bottleneck"


def test_prompted_resnet_is_frozen_and_uses_running_stats() -> None:
    torch.manual_seed(0)
    net = build_backbone("resnet_mini_18")
    pr = PromptedResNet(net)
    pr.train()
    assert not net.training and all(not m.training for m in net.modules())
    stats = {k: v.clone() for k, v in net.state_dict().items()}
    pad = pr.make_pad_prompt(init="normal", generator=torch.Generator().manual_seed(1))
    out = pr(_x(), pad)
    assert out.shape == (3, 128) and pr.feature_dim == 128 and pr.depth == 4
    out.sum().backward()
    assert pad.prompt_lr.grad.abs().sum() > 0 and pad.prompt_tb.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in net.parameters())
    assert all(torch.equal(v, stats[k]) for k, v in net.state_dict().items())  # BN running stats untouched
    with torch.no_grad():
        torch.testing.assert_close(pr(_x()), net(_x()), atol=0, rtol=0)  # no pad: the plain backbone
        # zero pixels in normalised space are a real input: padding changes the features
        assert not torch.allclose(pr(_x(), PixelPadPrompt(16)), net(_x()))
    with pytest.raises(ValueError, match="headless"):
        import torchvision

        PromptedResNet(torchvision.models.resnet18(weights=None))


def test_prompted_torchvision_resnet_at_32px() -> None:
    pr = PromptedResNet(build_backbone("resnet18"))
    pad = PixelPadPrompt(32)  # FedHPL's CIFAR setting: 38x38 into a 224-px ResNet
    assert pr(_x(b=2, s=32), pad).shape == (2, 512) and pr.img_size == 224


def test_bf16_autocast() -> None:
    pr = PromptedResNet(build_backbone("resnet_mini_50"))
    pad = PixelPadPrompt(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pr(_x(), pad)
    assert out.shape == (3, 512) and torch.isfinite(out.float()).all()
    out.float().sum().backward()
    assert pad.prompt_lr.grad is not None


def test_pretrain_resnet_deterministic(tmp_path) -> None:
    b = _tiny_bundle()
    kw = dict(epochs=1, batch_size=32, seed=5, threads=1, progress=False)
    s1 = pretrain_backbone(b, "resnet_mini_18", out_path=tmp_path / "a.pt", **kw)
    pretrain_backbone(b, "resnet_mini_18", out_path=tmp_path / "b.pt", **kw)
    w1, w2 = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    torch.manual_seed(5)
    init = build_backbone("resnet_mini_18").state_dict()
    assert set(w1) == set(init)  # backbone only, BatchNorm buffers included: no head
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["bn1.running_mean"], init["bn1.running_mean"])  # BN trained in train mode
    assert s1["steps"] == 2 and s1["backbone_params"] == 307_536 and 0 <= s1["train_acc"] <= 1
    build_backbone("resnet_mini_18", tmp_path / "a.pt")  # the written file loads through the builder
    with pytest.raises(ValueError, match="clip"):
        pretrain_backbone(b, "clip_vit_b16", **kw)
