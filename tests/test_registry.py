"""The backbone registry: architectures as data, weight-tag input configs, one builder, the prompt adapters."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from fedcore.backbones import registry as reg
from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.registry import (
    ARCH_SPECS,
    PRETRAINED_CFGS,
    ArchSpec,
    PretrainedCfg,
    WeightFileError,
    arch_info,
    build_backbone,
    input_cfg,
    model_facts,
    prompt_adapter,
    split_tag,
)
from fedcore.backbones.resnet import PromptedResNet
from fedcore.backbones.vit import ARCHS, backbone_info, build_vit

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TINY_CLIP = dict(embed_dim=16, vision_cfg=dict(image_size=16, layers=2, width=32, patch_size=4, head_width=16),
                 text_cfg=dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1))


@pytest.fixture
def scratch_registry():
    """Lets a test register archs; the registry is restored afterwards."""
    specs, cfgs = dict(ARCH_SPECS), dict(PRETRAINED_CFGS)
    yield
    ARCH_SPECS.clear()
    ARCH_SPECS.update(specs)
    PRETRAINED_CFGS.clear()
    PRETRAINED_CFGS.update(cfgs)


def test_tables_are_consistent() -> None:
    for arch, spec in ARCH_SPECS.items():
        assert spec.family in reg.FAMILIES and spec.source in reg.SOURCES, arch
        assert f"{arch}.{spec.default_tag}" in PRETRAINED_CFGS, arch
        assert spec.depth > 0 and spec.dim > 0, arch
    for key, cfg in PRETRAINED_CFGS.items():
        arch, tag = key.split(".", 1)
        assert arch in ARCH_SPECS and tag, key
        assert len(cfg.mean) == len(cfg.std) == 3 and cfg.img_size > 0, key


# fedhpl spec §9 / Table 5 (ViT backbones incl. the final norm) and Table 7 (torchvision ResNets without fc)
PAPER_PARAMS = {"vit_small_patch16_224": 21_665_664, "vit_base_patch16_224": 85_798_656,
                "vit_large_patch16_224": 303_301_632, "resnet18": 11_176_512, "resnet34": 21_284_672,
                "resnet50": 23_508_032, "vit_small_h12_patch16_224": 21_665_664}  # MoCo v3's ViT-S: 12 heads


@pytest.mark.parametrize("arch", sorted(ARCH_SPECS))
def test_static_facts_match_the_built_model(arch: str) -> None:
    with torch.device("meta"):  # no memory, no init cost: ViT-L and CLIP build in about a second
        model = build_backbone(arch)
    facts, info = model_facts(model), arch_info(arch)
    assert facts == {k: info[k] for k in ("family", "depth", "dim", "patch_size")}
    size = input_cfg(arch)["img_size"]
    assert model.pretrained_cfg["input_size"] == (3, size, size)
    if arch in PAPER_PARAMS:
        assert sum(p.numel() for p in model.parameters()) == PAPER_PARAMS[arch]


def test_input_cfgs() -> None:
    half = dict(mean=(0.5,) * 3, std=(0.5,) * 3)
    assert input_cfg("vit_base_patch16_224", "orig_in21k") == dict(img_size=224, **half)
    assert input_cfg("vit_base_patch16_224") == input_cfg("vit_base_patch16_224", "orig_in21k")
    assert input_cfg("resnet50", "tv_in1k") == dict(img_size=224, mean=(0.485, 0.456, 0.406),
                                                    std=(0.229, 0.224, 0.225))
    assert input_cfg("vit_mini", "digits") == dict(img_size=16, **half)
    with pytest.raises(ValueError, match="orig_in21k"):
        input_cfg("vit_base_patch16_224", "no_such_tag")
    with pytest.raises(ValueError, match="known archs"):
        arch_info("resnet_huge")


def test_arch_info_without_building() -> None:
    info = arch_info("resnet_mini_50")
    assert (info["family"], info["source"], info["builder"], info["depth"], info["dim"]) == (
        "resnet", "fedcore", "MiniResNet", 4, 512)
    large = arch_info("vit_large_patch16_224")
    assert large["depth"] == 24 and large["dim"] == 1024 and "orig_in21k" in large["tags"]


def test_vit_mini_builds_as_before() -> None:
    # the construction fedcore used before the registry: same init under the same seed, same keys
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    ref = VisionTransformer(img_size=16, patch_size=4, embed_dim=64, depth=4, num_heads=4, mlp_ratio=4.0,
                            num_classes=0).state_dict()
    torch.manual_seed(0)
    sd = build_backbone("vit_mini").state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    assert ARCHS["vit_mini"] == dict(kwargs=dict(img_size=16, patch_size=4, embed_dim=64, depth=4, num_heads=4,
                                                 mlp_ratio=4.0), patch_size=4, img_size=16, mean=(0.5,) * 3,
                                     std=(0.5,) * 3)
    assert ARCHS["vit_base_patch16_224"]["timm"] == "vit_base_patch16_224" and "resnet18" not in ARCHS


def test_archs_view_assignment_builds_the_edited_config(scratch_registry) -> None:
    import copy

    # benchmarks/bench_pretrain.py --mlp-ratio: assign a copy, then edit its kwargs
    ARCHS["vit_mini"] = cfg = copy.deepcopy(ARCHS["vit_mini"])
    cfg["kwargs"]["mlp_ratio"] = 2.0
    assert build_vit("vit_mini").blocks[0].mlp.fc1.out_features == 128


def test_tag_sets_the_input_contract() -> None:
    m = build_backbone("resnet_mini_18", tag="digits")
    assert (m.fedcore_arch, m.fedcore_tag) == ("resnet_mini_18", "digits")
    assert backbone_info(m) == dict(embed_dim=128, depth=4, img_size=16, mean=(0.5,) * 3, std=(0.5,) * 3,
                                    family="resnet")
    with pytest.raises(ValueError, match="not a ViT"):
        build_vit("resnet_mini_18")


def test_artifact_and_probe_builders_take_the_weight_tag(scratch_registry) -> None:
    """Features and t-SNE jobs get 'arch.tag' (plan.arch_tag), as training does: a non-default tag's input contract
    (here other mean/std, like MAE's ImageNet statistics against the arch's 0.5) reaches the built ViT."""
    PRETRAINED_CFGS["vit_mini.imagenet_like"] = PretrainedCfg(16, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert split_tag("vit_mini.imagenet_like") == ("vit_mini", "imagenet_like")
    assert split_tag("vit_mini") == ("vit_mini", None)
    tagged, plain = backbone_info(build_vit("vit_mini.imagenet_like")), backbone_info(build_vit("vit_mini"))
    assert tagged["mean"] == (0.485, 0.456, 0.406) and plain["mean"] == (0.5,) * 3


def test_vit_tag_size_must_fit(scratch_registry) -> None:
    PRETRAINED_CFGS["vit_mini.big"] = PretrainedCfg(32, (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(ValueError, match="32-px"):
        build_backbone("vit_mini", tag="big")


def test_prompt_adapters() -> None:
    assert isinstance(prompt_adapter(build_backbone("vit_mini")), PromptedViT)
    adapter = prompt_adapter(build_backbone("resnet_mini_50"))
    assert isinstance(adapter, PromptedResNet) and (adapter.feature_dim, adapter.depth) == (512, 4)
    assert PromptedViT(build_backbone("vit_mini_l")).feature_dim == 80


def test_torchvision_weight_file(tmp_path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = build_backbone("resnet18").eval()
    sd = dict(model.state_dict())
    sd["fc.weight"], sd["fc.bias"] = torch.zeros(1000, 512), torch.zeros(1000)  # torchvision files keep fc
    save_file(sd, str(tmp_path / "r18.safetensors"))
    _assert_loads_as(model, tmp_path / "r18.safetensors")
    del sd["layer4.1.bn2.running_mean"]
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(WeightFileError, match=r"bad\.pt.*missing.*layer4\.1\.bn2\.running_mean"):
        build_backbone("resnet18", tmp_path / "bad.pt")
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        build_backbone("resnet34", tmp_path / "nope.pth")


def _assert_loads_as(model: torch.nn.Module, path: Path) -> None:
    """resnet18 built from the file at ``path`` computes exactly what ``model`` computes."""
    loaded = build_backbone("resnet18", path).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)


def test_torchvision_file_without_batch_counters(tmp_path) -> None:
    """torchvision's model-zoo ResNet files predate BatchNorm's num_batches_tracked (PyTorch 0.4.1); torch's own
    strict load fills the counters in, and so must ours: every other tensor is still required."""
    torch.manual_seed(0)
    model = build_backbone("resnet18").eval()
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save({**sd, "fc.weight": torch.zeros(1000, 512), "fc.bias": torch.zeros(1000)}, tmp_path / "zoo.pth")
    _assert_loads_as(model, tmp_path / "zoo.pth")
    del sd["layer4.1.bn2.running_var"]
    torch.save(sd, tmp_path / "short.pth")
    with pytest.raises(WeightFileError, match=r"1 backbone tensors missing .*layer4\.1\.bn2\.running_var"):
        build_backbone("resnet18", tmp_path / "short.pth")


def test_fedcore_weight_file_is_strict(tmp_path) -> None:
    torch.manual_seed(0)
    sd = build_backbone("resnet_mini_34").state_dict()
    torch.save(sd, tmp_path / "ok.pt")
    loaded = build_backbone("resnet_mini_34", tmp_path / "ok.pt").state_dict()
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    torch.save({**sd, "head.weight": torch.zeros(3, 128)}, tmp_path / "extra.pt")
    with pytest.raises(RuntimeError, match=r"extra\.pt.*unexpected.*head\.weight"):  # still a RuntimeError
        build_backbone("resnet_mini_34", tmp_path / "extra.pt")
    torch.save(build_backbone("resnet_mini_18").state_dict(), tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other\.pt"):  # ... and a ValueError
        build_backbone("resnet_mini_34", tmp_path / "other.pt")


def test_open_clip_config_as_kwargs(tmp_path, scratch_registry) -> None:
    spec = ArchSpec("clip", "open_clip", "tiny", dict(model_cfg=TINY_CLIP), depth=2, dim=16, patch_size=4,
                    default_tag="random")
    reg.register_arch("clip_tiny", spec, {"random": PretrainedCfg(16, *reg.CLIP_NORM.values())})
    torch.manual_seed(0)
    model = build_backbone("clip_tiny").eval()
    assert model_facts(model) == dict(family="clip", depth=2, dim=16, patch_size=4)
    img, txt = torch.randn(2, 3, 16, 16), torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        ref = model.encode_image(img), model.encode_text(txt)
    torch.save(model.state_dict(), tmp_path / "clip.pt")
    loaded = build_backbone("clip_tiny", tmp_path / "clip.pt").eval()
    with torch.no_grad():
        for a, b in zip((loaded.encode_image(img), loaded.encode_text(txt)), ref):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.save({k: v for k, v in model.state_dict().items() if not k.startswith("visual.proj")}, tmp_path / "bad.pt")
    with pytest.raises(WeightFileError, match=r"bad\.pt"):
        build_backbone("clip_tiny", tmp_path / "bad.pt")
    from fedcore.backbones.clip import PromptedCLIP

    assert isinstance(prompt_adapter(model), PromptedCLIP)


def test_open_clip_registered_config(tmp_path, scratch_registry) -> None:
    import open_clip

    (tmp_path / "fedcore-test-tiny-clip.json").write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(tmp_path / "fedcore-test-tiny-clip.json")  # open_clip's own registry, offline
    spec = ArchSpec("clip", "open_clip", "fedcore-test-tiny-clip", {}, depth=2, dim=16, patch_size=4,
                    default_tag="random")
    reg.register_arch("clip_tiny_named", spec, {"random": PretrainedCfg(16, *reg.CLIP_NORM.values())})
    model = build_backbone("clip_tiny_named")
    assert model.encode_image(torch.randn(1, 3, 16, 16)).shape == (1, 16)
    with pytest.raises(ValueError, match="already registered"):
        reg.register_arch("clip_tiny_named", spec, {})


def test_backbones_yaml_resolves_in_the_registry() -> None:
    from fedcore.config import validate

    schema = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())
    entries = yaml.safe_load((ROOT / "config" / "backbones.yaml").read_text())
    for name, entry in entries.items():
        validate(entry, schema, "backbone_entry", name)
        spec = reg.arch_spec(entry["arch"])
        input_cfg(entry["arch"], entry.get("tag"))  # the tag exists
        if "pretrain" in entry:  # only our tiny archs can be pretrained by the pipeline (the mini CLIP: open_clip's)
            assert (spec.source, spec.family) in {("fedcore", "vit"), ("fedcore", "resnet"), ("open_clip", "clip")}
            assert spec.family != "clip" or entry["pretrain"]["objective"] == "clip", name
    for arch in ("vit_mini_s", "vit_mini", "vit_mini_l", "resnet_mini_18", "resnet_mini_34", "resnet_mini_50"):
        assert arch in {e["arch"] for e in entries.values() if "pretrain" in e}
    # a training job builds "arch" or "arch.tag" (rules/common.smk run_archs): a non-default tag's contract is used
    from fedcore.backbones.registry import build_backbone

    ft = entries["vit_b16_ft1k"]
    assert ft["tag"] != ARCH_SPECS[ft["arch"]].default_tag
    with torch.device("meta"):
        assert build_backbone(ft["arch"], None, ft["tag"]).fedcore_tag == ft["tag"]
