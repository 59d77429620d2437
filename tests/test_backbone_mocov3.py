"""Self-supervised paper-scale backbones: MoCo v3 checkpoints converted on load, MAE's tag, pinned checksums."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import yaml

from fedcore.backbones import registry as reg
from fedcore.backbones.registry import (ARCH_SPECS, IMAGENET_NORM, PRETRAINED_CFGS, UNPINNED, ArchSpec,
                                        PretrainedCfg, WeightFileError, build_backbone, mocov3_to_timm)

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TINY = "vit_tiny_mocov3_test"


def moco_layout_keys(depth: int) -> list[str]:
    """The state_dict keys of a MoCo v3 ViT training checkpoint, written out from facebookresearch/moco-v3
    (vits.py on timm 0.4's VisionTransformer; builder.py's 3-layer projector as the encoders' ``head`` and
    2-layer predictor, BatchNorm1d after each Linear, the last one without affine), wrapped by DDP (``module.``)."""
    vit = ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight", "norm.bias"]
    for i in range(depth):
        for layer in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            vit += [f"blocks.{i}.{layer}.weight", f"blocks.{i}.{layer}.bias"]
    bn = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    stats = ["running_mean", "running_var", "num_batches_tracked"]
    projector = ["head.0.weight", *(f"head.1.{b}" for b in bn), "head.3.weight", *(f"head.4.{b}" for b in bn),
                 "head.6.weight", *(f"head.7.{b}" for b in stats)]
    predictor = ["predictor.0.weight", *(f"predictor.1.{b}" for b in bn), "predictor.3.weight",
                 *(f"predictor.4.{b}" for b in stats)]
    return ([f"module.base_encoder.{k}" for k in vit + projector]
            + [f"module.momentum_encoder.{k}" for k in vit + projector] + [f"module.{k}" for k in predictor])


@pytest.mark.parametrize("arch", ["vit_small_h12_patch16_224", "vit_base_patch16_224"])
def test_moco_layout_maps_onto_every_timm_key(arch: str) -> None:
    with torch.device("meta"):
        model = build_backbone(arch, tag="mocov3_in1k")
    own = model.state_dict()
    assert set(mocov3_to_timm(dict.fromkeys(moco_layout_keys(12), torch.zeros(0)))) == set(own)
    assert model.pretrained_cfg["mean"] == IMAGENET_NORM["mean"]  # spec fedhpl §8.8
    assert all(b.attn.num_heads == 12 for b in model.blocks)  # moco-v3 vits.py: 12 heads for ViT-S and ViT-B


def test_mae_tag_is_timm_vit_large_with_imagenet_norm() -> None:
    with torch.device("meta"):
        model = build_backbone("vit_large_patch16_224", tag="mae")
    assert model.pretrained_cfg["std"] == IMAGENET_NORM["std"] and len(model.blocks) == 24


@pytest.fixture
def tiny_moco_arch():
    """A 2-block timm ViT at 32 px with 12 heads registered with a MoCo v3 tag; the registry is restored after."""
    specs, cfgs = dict(ARCH_SPECS), dict(PRETRAINED_CFGS)
    spec = ArchSpec("vit", "timm", "vit_small_patch16_224", dict(img_size=32, embed_dim=48, depth=2, num_heads=12),
                    depth=2, dim=48, patch_size=16, default_tag="mocov3_in1k")
    reg.register_arch(TINY, spec, {"mocov3_in1k": PretrainedCfg(32, **IMAGENET_NORM, layout="mocov3")})
    yield
    ARCH_SPECS.clear()
    ARCH_SPECS.update(specs)
    PRETRAINED_CFGS.clear()
    PRETRAINED_CFGS.update(cfgs)


def fake_moco_checkpoint(path: Path, drop: str | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint in MoCo v3's layout with random weights (the momentum encoder differs from the base
    encoder); returns the base encoder's ViT tensors under timm's names."""
    gen = torch.Generator().manual_seed(0)
    sd = {key: torch.randn(4, generator=gen) for key in moco_layout_keys(2)}  # heads: dropped on load
    template = build_backbone(TINY).state_dict()
    for k, v in template.items():  # the two encoders' ViT tensors, in their real shapes
        sd[f"module.base_encoder.{k}"] = torch.randn(v.shape, generator=gen)
        sd[f"module.momentum_encoder.{k}"] = torch.randn(v.shape, generator=gen)
    expected = {k: sd[f"module.base_encoder.{k}"] for k in template}
    if drop:
        del sd[drop]
    torch.save({"epoch": 300, "arch": "vit_small", "state_dict": sd,
                "optimizer": {"state": {}, "param_groups": [{"lr": 1.5e-4, "betas": (0.9, 0.95)}]}}, path)
    return expected


def test_fake_checkpoint_loads_the_base_encoder(tmp_path, tiny_moco_arch) -> None:
    path = tmp_path / "vit-s-300ep.pth.tar"
    expected = fake_moco_checkpoint(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    model = build_backbone(TINY, path, sha256=digest)
    got = model.state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 48)


def test_checksum_is_enforced(tmp_path, tiny_moco_arch) -> None:
    path = tmp_path / "vit-s-300ep.pth.tar"
    fake_moco_checkpoint(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(WeightFileError, match=f"has sha256 {digest}, but the `sha256:` of the backbone entry "
                                              "with `weights: vit-s-300ep.pth.tar`"):
        build_backbone(TINY, path, sha256="0" * 64)
    with pytest.raises(WeightFileError, match=f"no pinned checksum: its sha256 is {digest}"):
        build_backbone(TINY, path, sha256=UNPINNED)
    with pytest.raises(ValueError, match="no weight file"):
        build_backbone(TINY, None, sha256=digest)


def test_bad_layouts_are_refused(tmp_path, tiny_moco_arch) -> None:
    plain = tmp_path / "timm_layout.pth"
    torch.save(build_backbone(TINY).state_dict(), plain)  # a timm state dict where a MoCo checkpoint belongs
    with pytest.raises(WeightFileError, match="mocov3 key layout .*: not a MoCo v3 checkpoint .* 30 other keys"):
        build_backbone(TINY, plain)
    short = tmp_path / "short.pth.tar"
    fake_moco_checkpoint(short, drop="module.base_encoder.blocks.1.mlp.fc2.weight")
    with pytest.raises(WeightFileError, match=r"1 backbone tensors missing \(e.g. \['blocks.1.mlp.fc2.weight'\]\)"):
        build_backbone(TINY, short)
    other = tmp_path / "other.pth.tar"
    sd = {"module.base_encoder.cls_token": torch.zeros(1, 1, 48), "module.queue": torch.zeros(3)}
    torch.save({"state_dict": sd}, other)
    with pytest.raises(WeightFileError, match=r"1 other keys, e.g. \['queue'\]"):
        build_backbone(TINY, other)


def test_paper_entries_pin_their_files() -> None:
    entries = yaml.safe_load((ROOT / "config" / "backbones.yaml").read_text())
    ssl = {k: v for k, v in entries.items() if v.get("tag") in ("mocov3_in1k", "mae")}
    assert sorted(ssl) == ["vit_b16_mocov3", "vit_l16_mae", "vit_s16_mocov3"]
    for name, entry in ssl.items():
        assert "sha256" in entry and "source" in entry, name  # null until the user pins the checked file
