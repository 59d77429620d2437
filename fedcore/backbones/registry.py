"""Backbone architectures as data, and one builder for every family (timm's registry + ``default_cfgs`` idea).

Two tables:

* ``ARCH_SPECS``: arch name -> ``ArchSpec``: the family (``vit`` | ``resnet`` | ``clip``), who builds it
  (``timm`` | ``torchvision`` | ``open_clip`` | ``fedcore``), the builder's own name and kwargs, and the static
  facts callers need without building it (depth, feature dim, patch size).
* ``PRETRAINED_CFGS``: ``"<arch>.<tag>"`` -> ``PretrainedCfg``: what a set of weights expects as input
  (image size, mean, std) and where such weights come from. The tag names a weight set, as in timm
  (``vit_base_patch16_224.orig_in21k``, ``resnet50.tv_in1k``); ``vit_mini.digits`` is the pipeline's own.

``config/backbones.yaml`` names concrete backbones (arch + tag + weight file or pretrain settings) built from
these. Nothing here downloads: weights come from a local file or the model stays randomly initialised.
"""
from __future__ import annotations

import copy
import zipfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from fedcore.backbones.clip import PromptedCLIP
from fedcore.backbones.plain_vit import PlainViT, is_vit
from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.resnet import MiniResNet, PromptedResNet, StemResNet, resnet_feature_dim, resnet_stages
from fedcore.data.download import file_digests
from fedcore.io import rebuild_hint, unreadable

FAMILIES = ("vit", "resnet", "clip")
SOURCES = ("timm", "torchvision", "open_clip", "fedcore")
# Families that take any input size (global pooling): a run may feed them images of another size than their
# weights' (FedHPL Fig. 10's ResNets at 32 px); a ViT's or CLIP's position embedding fixes theirs.
ANY_INPUT_SIZE = ("resnet",)

IN21K_NORM = dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))  # Google's ViTs are trained on [-1, 1] inputs
IMAGENET_NORM = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
CLIP_NORM = dict(mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: how to build it, and the static facts callers need without building it."""

    family: str  # vit | resnet | clip: picks the prompt adapter
    source: str  # timm | torchvision | open_clip | fedcore: picks the builder
    builder: str  # the builder's own name: timm/torchvision/open_clip model name, or a fedcore class
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # builder kwargs (fedcore: the whole config)
    depth: int = 0  # transformer blocks (vit; clip image tower) or residual stages (resnet) prompts can address
    dim: int = 0  # feature dim given to the head: ViT embed dim, ResNet pooled channels, CLIP joint embed dim
    patch_size: int | None = None  # ViT / CLIP image tower patch side; None for CNNs
    default_tag: str = ""  # weight tag used when none is given (must be in PRETRAINED_CFGS)
    classifier: str | None = None  # state-dict prefix of a classifier that weight files carry and we drop


@dataclass(frozen=True)
class PretrainedCfg:
    """What one weight set expects as input, and where it comes from (a timm ``default_cfg`` in miniature)."""

    img_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    source: str = ""  # where such weights come from (documentation and messages only)
    rule: str = ""  # the pipeline rule that writes such weight files; "" for a file the user supplies
    layout: str = ""  # the key layout of such files when it is not the builder's own (WEIGHT_LAYOUTS)


class WeightFileError(ValueError, RuntimeError):
    """A weight file that does not fit its architecture.

    Both bases on purpose: a wrong file was a RuntimeError (torch's strict load) for built-in archs and a
    ValueError (missing tensors) for timm archs; callers catching either keep working.
    """


# ---- the architecture table -------------------------------------------------------------------------
def _vit_mini(dim: int, depth: int, heads: int) -> ArchSpec:
    """A tiny 16-px ViT (4-px patches: 16 tokens + CLS), head dim 16 like the ViT-S/B/L family's 64 scaled."""
    kwargs = dict(img_size=16, patch_size=4, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=4.0)
    return ArchSpec("vit", "fedcore", "PlainViT", kwargs, depth=depth, dim=dim, patch_size=4,
                    default_tag="digits")


def _vit_scratch(img_size: int, dim: int, depth: int, heads: int, mlp_ratio: float) -> ArchSpec:
    """A small ViT (4-px patches) that a method trains from scratch at the images' own size (tag ``scratch``)."""
    kwargs = dict(img_size=img_size, patch_size=4, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=mlp_ratio)
    return ArchSpec("vit", "fedcore", "PlainViT", kwargs, depth=depth, dim=dim, patch_size=4, default_tag="scratch")


def _resnet_mini(block: str, layers: tuple[int, ...], width: int = 16) -> ArchSpec:
    """A tiny 16-px ResNet (fedcore.backbones.resnet.MiniResNet)."""
    expansion = 4 if block == "bottleneck" else 1
    return ArchSpec("resnet", "fedcore", "MiniResNet", dict(block=block, layers=layers, width=width), depth=4,
                    dim=8 * width * expansion, default_tag="digits")


def _stem_resnet(layers: tuple[int, ...], widths: tuple[int, ...]) -> ArchSpec:
    """A torchvision-style ResNet of BasicBlocks trained from scratch (fedcore.backbones.resnet.StemResNet)."""
    return ArchSpec("resnet", "fedcore", "StemResNet", dict(layers=layers, widths=widths), depth=len(layers),
                    dim=widths[-1], default_tag="scratch")


def _timm_vit(name: str, dim: int, depth: int, default_tag: str) -> ArchSpec:
    """A timm ViT at 224 px with 16-px patches, built headless."""
    return ArchSpec("vit", "timm", name, {}, depth=depth, dim=dim, patch_size=16, default_tag=default_tag)


def _moco_vit(name: str, dim: int) -> ArchSpec:
    """A timm ViT at 224 px as MoCo v3's ``vits.py`` builds it: 12 heads at every width (timm's ViT-S has 6)."""
    return ArchSpec("vit", "timm", name, dict(num_heads=12), depth=12, dim=dim, patch_size=16,
                    default_tag="mocov3_in1k")


def _tv_resnet(name: str, dim: int) -> ArchSpec:
    """A torchvision ResNet, built headless (fc = Identity); its weight files keep `fc`, which is dropped."""
    return ArchSpec("resnet", "torchvision", name, {}, depth=4, dim=dim, default_tag="tv_in1k", classifier="fc.")


def _clip_mini(embed_dim: int, vision: dict, text: dict) -> ArchSpec:
    """A tiny open_clip CLIP (16-px images, 4-px patches: M = 16; BPE text of 32 tokens) built from its config."""
    model_cfg = dict(embed_dim=embed_dim, vision_cfg=dict(image_size=16, patch_size=4, **vision),
                     text_cfg=dict(context_length=32, vocab_size=49408, **text))  # open_clip's BPE vocabulary
    return ArchSpec("clip", "open_clip", "CLIP", dict(model_cfg=model_cfg), depth=vision["layers"], dim=embed_dim,
                    patch_size=4, default_tag="digits")


ARCH_SPECS: dict[str, ArchSpec] = {
    # Mini scale (pretrained by the pipeline on the held-out digits split; see rules/backbones.smk).
    # Three tiny ViTs for a heterogeneous-ViT setting mirroring ViT-S/B/L: _s halves the width at the same
    # depth (S vs B), _l widens 1.25x and deepens 1.5x (L: 1.33x and 2x). Pretraining fwd+bwd on one CPU
    # thread runs at 2.0x / 1x / 0.56x vit_mini's speed (~1,900 img/s alone), so _l keeps ~1,000 img/s;
    # 96 wide and 6 deep was 0.4x. vit_mini is the default pipeline's backbone.
    "vit_mini_s": _vit_mini(dim=32, depth=4, heads=2),
    "vit_mini": _vit_mini(dim=64, depth=4, heads=4),
    "vit_mini_l": _vit_mini(dim=80, depth=6, heads=5),
    # Three tiny ResNets mirroring ResNet-18/34/50 (FedHPL's heterogeneous CNN clients): stage depths
    # (2,2,2,2) and (3,4,6,3) roughly halved, width 16..128 (BasicBlock: dim 128; Bottleneck: dim 512).
    # Pretraining fwd+bwd runs at 2.1x / 1.25x / 0.94x vit_mini's speed on one thread.
    "resnet_mini_18": _resnet_mini("basic", (1, 1, 1, 1)),
    "resnet_mini_34": _resnet_mini("basic", (1, 2, 3, 1)),
    "resnet_mini_50": _resnet_mini("bottleneck", (1, 2, 3, 1)),
    # pFedPT's own ViT (hkgdifyu/pFedPT VisionTransformer defaults: 32 px, patch 4, dim 128, depth 8, 8 heads, MLP
    # ratio 2, qkv bias): 1,074,816 params headless, 1.026 M / 1.037 M (2^20) with a 10- / 100-class head (FedHPL
    # Table 5). Its mini analogue keeps the mini images' 16 px and 4-px patches (17 tokens, as vit_mini), MLP
    # ratio 2, and vit_mini_s's width and depth (dim 32, 4 blocks, 2 heads): ~36 K params, cheap on a CPU.
    "vit_pfedpt": _vit_scratch(32, dim=128, depth=8, heads=8, mlp_ratio=2.0),
    "vit_pfedpt_mini": _vit_scratch(16, dim=32, depth=4, heads=2, mlp_ratio=2.0),
    # FedOTP's mini CLIP: vit_mini's image tower (width 64, 4 blocks, 4 heads of 16) and a 2-block text tower
    # of the same width, pretrained contrastively on the held-out digits (pretrain/clip.py).
    "clip_mini": _clip_mini(64, dict(width=64, layers=4, head_width=16), dict(width=64, heads=4, layers=2)),
    # FedPFT's extractors, trained from scratch by every FedPFT method (spec fedpft §1.2): ResNet-8 (CIFAR-10) and
    # ResNet-10 (CIFAR-100, Tiny-ImageNet) with torchvision's 7x7 stem; trunk 1,232,704 / 4,905,792 parameters.
    # Their mini analogues keep the stages and quarter the widths (16 px digits: the stem leaves 4x4).
    "resnet8_pft": _stem_resnet((1, 1, 1), (64, 128, 256)),
    "resnet10_pft": _stem_resnet((1, 1, 1, 1), (64, 128, 256, 512)),
    "resnet8_pft_mini": _stem_resnet((1, 1, 1), (16, 32, 64)),
    "resnet10_pft_mini": _stem_resnet((1, 1, 1, 1), (16, 32, 64, 128)),
    # Paper scale: local weight files only.
    "vit_small_patch16_224": _timm_vit("vit_small_patch16_224", 384, 12, "augreg_in21k"),
    "vit_base_patch16_224": _timm_vit("vit_base_patch16_224", 768, 12, "orig_in21k"),
    "vit_large_patch16_224": _timm_vit("vit_large_patch16_224", 1024, 24, "orig_in21k"),
    # MoCo v3's ViT-S (facebookresearch/moco-v3 vits.vit_small): timm's ViT-S/16 shapes with 12 heads of 32, so
    # the same tensors as ViT-S but another function. Its ViT-B is timm's ViT-B/16 (12 heads already).
    "vit_small_h12_patch16_224": _moco_vit("vit_small_patch16_224", 384),
    "resnet18": _tv_resnet("resnet18", 512),
    "resnet34": _tv_resnet("resnet34", 512),
    "resnet50": _tv_resnet("resnet50", 2048),
    # FedOTP's CLIP ViT-B/16 (OpenAI weights need QuickGELU; a bare file carries no tag, so force it).
    # dim = joint image-text embedding; depth = image-tower blocks.
    "clip_vit_b16": ArchSpec("clip", "open_clip", "ViT-B-16", dict(force_quick_gelu=True), depth=12, dim=512,
                             patch_size=16, default_tag="openai"),
}

_DIGITS = "pretrained by the pipeline on the digits bundle's held-out pretrain split (rule pretrain_backbone)"
_DIGITS_CFG = PretrainedCfg(16, **IN21K_NORM, source=_DIGITS, rule="pretrain_backbone")
# the same split without its labels, by MoCo v3 (pretrain/moco.py): the self-supervised twins of the tiny ViTs
_DIGITS_MOCO_CFG = PretrainedCfg(16, **IN21K_NORM, source=_DIGITS.replace("pretrained", "self-supervised (MoCo v3)"),
                                 rule="pretrain_backbone")
# the same split with captions made from its labels and styles, by CLIP's contrastive objective (pretrain/clip.py)
_DIGITS_CLIP_CFG = PretrainedCfg(16, **IN21K_NORM, source=_DIGITS.replace("pretrained", "image-text pretrained (CLIP)"),
                                 rule="pretrain_backbone")

# no weight file: a method builds these archs and trains them from random weights; PFLlib's CIFAR/SVHN inputs
_SCRATCH = "random init, trained from scratch by the method that names it (no weight file)"

_TIMM_VIT_TAGS = {  # the timm weight tags whose input contract we know (224 px, mean = std = 0.5)
    "vit_small_patch16_224": ("augreg_in21k", "augreg_in21k_ft_in1k"),
    "vit_base_patch16_224": ("orig_in21k", "augreg_in21k", "augreg_in21k_ft_in1k"),
    "vit_large_patch16_224": ("orig_in21k", "augreg_in21k", "augreg_in21k_ft_in1k"),
}

# MoCo v3 (Chen et al. 2021) self-supervised on ImageNet-1k: the official training checkpoints, converted on load
_MOCOV3 = ("MoCo v3, ImageNet-1k, 300 epochs: the official checkpoint (facebookresearch/moco-v3 CONFIG.md), "
           "state_dict keys module.base_encoder.*")
_MOCOV3_CFG = PretrainedCfg(224, **IMAGENET_NORM, source=_MOCOV3, layout="mocov3")

PRETRAINED_CFGS: dict[str, PretrainedCfg] = {
    **{f"{a}.digits": _DIGITS_CFG for a in ("vit_mini_s", "vit_mini", "vit_mini_l", "resnet_mini_18",
                                             "resnet_mini_34", "resnet_mini_50")},
    **{f"{a}.digits_moco": _DIGITS_MOCO_CFG for a in ("vit_mini_s", "vit_mini", "vit_mini_l")},
    "clip_mini.digits": _DIGITS_CLIP_CFG,
    "vit_pfedpt.scratch": PretrainedCfg(32, **IN21K_NORM, source=_SCRATCH),
    # FedPFT: CIFAR's 32 px (Tiny-ImageNet's runs set input_size 64), Normalize(0.5, 0.5) as its CIFAR-10 pipeline
    **{f"{a}.scratch": PretrainedCfg(32, **IN21K_NORM, source=_SCRATCH) for a in ("resnet8_pft", "resnet10_pft")},
    **{f"{a}.scratch": PretrainedCfg(16, **IN21K_NORM, source=_SCRATCH)
       for a in ("resnet8_pft_mini", "resnet10_pft_mini")},
    "vit_pfedpt_mini.scratch": PretrainedCfg(16, **IN21K_NORM, source=_SCRATCH),
    **{f"{arch}.{tag}": PretrainedCfg(224, **IN21K_NORM,
                                      source="timm (Google's original in21k)" if tag == "orig_in21k" else "timm")
       for arch, tags in _TIMM_VIT_TAGS.items() for tag in tags},
    "vit_small_h12_patch16_224.mocov3_in1k": _MOCOV3_CFG,
    "vit_base_patch16_224.mocov3_in1k": _MOCOV3_CFG,
    # MAE (He et al. 2022) self-supervised on ImageNet-1k: timm's copy of the official encoder, timm's keys
    "vit_large_patch16_224.mae": PretrainedCfg(224, **IMAGENET_NORM, source="timm vit_large_patch16_224.mae"),
    **{f"resnet{d}.tv_in1k": PretrainedCfg(224, **IMAGENET_NORM, source="torchvision IMAGENET1K_V1")
       for d in (18, 34, 50)},
    "clip_vit_b16.openai": PretrainedCfg(224, **CLIP_NORM, source="open_clip ViT-B-16 openai (safetensors copy)"),
}


def register_arch(name: str, spec: ArchSpec, tags: Mapping[str, PretrainedCfg], replace: bool = False) -> None:
    """Add an architecture and its weight tags to the registry (tests, benchmarks, new families)."""
    if spec.family not in FAMILIES or spec.source not in SOURCES:
        raise ValueError(f"family must be one of {FAMILIES} and source one of {SOURCES}, got {spec.family!r}, "
                         f"{spec.source!r}")
    if name in ARCH_SPECS and not replace:
        raise ValueError(f"arch {name!r} is already registered")
    if spec.default_tag not in tags and f"{name}.{spec.default_tag}" not in PRETRAINED_CFGS:
        raise ValueError(f"arch {name!r}: its default tag {spec.default_tag!r} has no pretrained config")
    ARCH_SPECS[name] = spec
    for tag, cfg in tags.items():
        PRETRAINED_CFGS[f"{name}.{tag}"] = cfg


def list_archs(family: str | None = None) -> list[str]:
    """Registered arch names, optionally of one family."""
    return [a for a, s in ARCH_SPECS.items() if family is None or s.family == family]


def arch_spec(arch: str) -> ArchSpec:
    """The ArchSpec of `arch`, or a ValueError listing the known archs."""
    if arch not in ARCH_SPECS:
        raise ValueError(f"unknown backbone arch {arch!r}; known archs: {sorted(ARCH_SPECS)}")
    return ARCH_SPECS[arch]


def split_tag(name: str) -> tuple[str, str | None]:
    """('arch', 'tag') of an 'arch.tag' name (a backbone's arch with its config/backbones.yaml weight tag, as
    plan.arch_tag writes it); ('arch', None) of a bare arch, whose default tag applies."""
    arch, _, tag = name.partition(".")
    return arch, tag or None


def arch_tags(arch: str) -> list[str]:
    """The weight tags registered for `arch`."""
    return [k.split(".", 1)[1] for k in PRETRAINED_CFGS if k.split(".", 1)[0] == arch]


def arch_info(arch: str) -> dict:
    """Static facts of `arch` without building it: family, source, builder, depth, dim, patch_size, tags."""
    spec = arch_spec(arch)
    info = {k: v for k, v in asdict(spec).items() if k != "kwargs"}
    return dict(arch=arch, **info, tags=arch_tags(arch))


def pretrained_cfg(arch: str, tag: str | None = None) -> PretrainedCfg:
    """The PretrainedCfg of `arch.tag` (the arch's default tag if None), or a ValueError listing its tags."""
    tag = arch_spec(arch).default_tag if tag is None else tag
    key = f"{arch}.{tag}"
    if key not in PRETRAINED_CFGS:
        raise ValueError(f"unknown weight tag {tag!r} for arch {arch!r}; known tags: {arch_tags(arch)}")
    return PRETRAINED_CFGS[key]


def input_cfg(arch: str, tag: str | None = None) -> dict:
    """The model input contract of weights `arch.tag`: dict(img_size, mean, std)."""
    cfg = pretrained_cfg(arch, tag)
    return dict(img_size=cfg.img_size, mean=tuple(cfg.mean), std=tuple(cfg.std))


# ---- weight files -----------------------------------------------------------------------------------
UNPINNED = "unpinned"  # build_backbone's sha256 for an entry with `sha256: null`: refused until pinned


def check_sha256(path: Path, arch: str, sha256: str | None) -> None:
    """A weight file must have the sha256 its config/backbones.yaml entry pins; `sha256: null` is refused.

    ``sha256`` is None (the entry has no ``sha256:`` key: not checked), ``UNPINNED`` (``sha256: null``), or the
    pinned hex digest. As for the raw datasets (config/checksums.yaml), an unpinned file is never used: the
    error prints its digest so that it can be pinned once the file has been checked against its source.
    """
    if sha256 is None:
        return
    actual = file_digests(path, ("sha256",))["sha256"]
    entry = f"the `sha256:` of the backbone entry with `weights: {path.name}` (arch {arch}) in config/backbones.yaml"
    if sha256 == UNPINNED:
        raise WeightFileError(f"{path} has no pinned checksum: its sha256 is {actual}; check the file against its "
                              f"source and pin that digest as {entry}")
    if actual != sha256.lower():
        raise WeightFileError(f"{path} has sha256 {actual}, but {entry} pins {sha256}: the file is damaged or "
                              f"another file; replace it (see the entry's `source:`) or fix the pin")


def mocov3_to_timm(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A MoCo v3 training checkpoint's state dict -> the base encoder's timm ViT state dict.

    The layout (facebookresearch/moco-v3 main_moco.py, moco/builder.py): ``module.base_encoder.*`` (the ViT,
    whose ``head`` is the 3-layer projection MLP), ``module.momentum_encoder.*`` and ``module.predictor.*``.
    As the repo's main_lincls.py does: keep base_encoder without its head, drop the rest. Keys may come with
    or without the ``module.`` prefix (read_state_dict strips it). Any other key is an error, not a silent drop.
    """
    out, other = {}, []
    for key, value in sd.items():
        k = key.removeprefix("module.")
        if k.startswith("base_encoder."):
            k = k.removeprefix("base_encoder.")
            if not k.startswith("head."):
                out[k] = value
        elif not k.startswith(("momentum_encoder.", "predictor.")):
            other.append(key)
    if not out or other:
        raise ValueError("not a MoCo v3 checkpoint (expected state_dict keys module.base_encoder.*, "
                         "module.momentum_encoder.*, module.predictor.* only): "
                         + (f"{len(other)} other keys, e.g. {sorted(other)[:5]}" if other else
                            f"no base_encoder keys; keys are e.g. {sorted(sd)[:5]}"))
    return out


# weight-file key layouts other than the builder's own: PretrainedCfg.layout -> converter to the builder's keys
WEIGHT_LAYOUTS: dict[str, Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    "mocov3": mocov3_to_timm,
}


def _check_file(arch: str, weights: str | Path, cfg: PretrainedCfg, sha256: str | None = None) -> Path:
    """Fail early, and say what to fix, when a configured weight file is absent, unpinned or cannot be read."""
    path = Path(weights)
    if not path.is_file():
        raise FileNotFoundError(
            f"weight file {str(path)!r} for backbone arch {arch!r} does not exist: fix the `weights:` key of "
            f"the backbone with `arch: {arch}` in config/backbones.yaml, or put the file there "
            f"(mini-scale weights such as vit_mini's are written by the pipeline's pretrain rule)"
        )
    check_sha256(path, arch, sha256)
    _file_keys(path, arch, cfg)  # a truncated download fails here, named, not inside timm or open_clip
    return path


def _recovery(arch: str, path: Path, cfg: PretrainedCfg) -> str:
    """How to get a good copy of a broken weight file: rebuild it (the pipeline's own) or fetch it again."""
    if cfg.rule:
        return rebuild_hint(cfg.rule)
    return (f"download it again or replace it with a complete copy: it is the `weights:` file {path.name!r} of "
            f"the backbone entry with `arch: {arch}` in config/backbones.yaml (its `source:` says where it "
            f"comes from)")


def read_state_dict(path: str | Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Load a safetensors or torch state dict, unwrapping a {'state_dict'|'model': ...} checkpoint."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(path))
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    for key in ("state_dict", "model"):
        if isinstance(sd.get(key), dict):
            sd = sd[key]
    return {k.removeprefix("module."): v for k, v in sd.items()}


def _read_weights(path: Path, arch: str, cfg: PretrainedCfg, keys_only: bool = False) -> Any:
    """The file's state dict (or only its parameter names), or a WeightFileError naming the file and the fix."""
    try:
        if not keys_only:
            return read_state_dict(path)
        if path.suffix == ".safetensors":  # names from the header, without reading tensors
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return {k.removeprefix("module.") for k in f.keys()}
        if path.suffix == ".npz":  # Google's JAX files (timm's own loader maps their names)
            with np.load(path, allow_pickle=False) as z:
                return set(z.files)
        # mmap reads only the zip index; torch's legacy (non-zip) format cannot be mapped
        return set(read_state_dict(path, mmap=zipfile.is_zipfile(path)))
    except Exception as e:  # noqa: BLE001 - torch, safetensors, zip and OS errors alike mean a bad file
        raise WeightFileError(unreadable(path, e, _recovery(arch, path, cfg))) from e


def _file_keys(path: Path, arch: str, cfg: PretrainedCfg) -> set[str]:
    """Parameter names stored in a weight file, read without loading tensors where the format allows."""
    return _read_weights(path, arch, cfg, keys_only=True)


def _load_strict(model: nn.Module, path: Path, arch: str, cfg: PretrainedCfg,
                 drop_prefix: str | None = None) -> None:
    """Load `path` into `model` strictly (after converting its layout and dropping a classifier), naming the
    file in any error."""
    sd = _read_weights(path, arch, cfg)
    if cfg.layout:
        try:
            sd = WEIGHT_LAYOUTS[cfg.layout](sd)
        except ValueError as e:
            raise WeightFileError(f"{path} does not have the {cfg.layout} key layout of its weight tag for arch "
                                  f"{arch}{f' ({cfg.source})' if cfg.source else ''}: {e}") from e
    if drop_prefix:
        sd = {k: v for k, v in sd.items() if not k.startswith(drop_prefix)}
    own = model.state_dict()
    # BatchNorm's batch counters (PyTorch >= 0.4.1) are absent from older files such as torchvision's model-zoo
    # ResNets; torch's strict load fills them in (0), and with momentum set they are never read
    missing = sorted(k for k in set(own) - set(sd) if not k.endswith(".num_batches_tracked"))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise WeightFileError(
            f"{path} is not a {arch} state dict: {len(missing)} backbone tensors missing (e.g. {missing[:5]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:5]})"
        )
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:  # shape mismatches
        raise WeightFileError(f"{path} does not fit arch {arch}: {e}") from e


# ---- builders, one per source -----------------------------------------------------------------------
def _build_timm(arch: str, spec: ArchSpec, path: Path | None, cfg: PretrainedCfg) -> nn.Module:
    """A headless timm model; a local file goes through timm's own loader (it drops the classifier)."""
    import timm

    # The bare arch name (no tag) on purpose: with it timm drops any classifier the file keeps (an
    # in21k file's 21843-class head); our tag only sets the input contract.
    if cfg.layout and path is not None:  # not timm's layout: build it bare, load the converted keys strictly
        model = timm.create_model(spec.builder, pretrained=False, num_classes=0, **spec.kwargs)
        _load_strict(model, path, arch, cfg)
        return model
    overlay = dict(mean=cfg.mean, std=cfg.std)
    if path is not None:
        # custom_load only for Google's JAX .npz; explicit so that older timm cannot route a torch file there
        overlay.update(file=str(path), custom_load=str(path).endswith(".npz"))
    model = timm.create_model(spec.builder, pretrained=path is not None, num_classes=0,
                              pretrained_cfg_overlay=overlay, **spec.kwargs)
    if path is not None and not str(path).endswith(".npz"):
        # timm loads non-strictly once it drops the classifier: make a wrong file an error, not random weights
        missing = sorted(set(model.state_dict()) - _file_keys(path, arch, cfg))
        if missing:
            raise WeightFileError(
                f"{path} is not a {spec.builder} state dict: {len(missing)} backbone tensors missing, "
                f"e.g. {missing[:5]}"
            )
    return model


def _build_torchvision(arch: str, spec: ArchSpec, path: Path | None, cfg: PretrainedCfg) -> nn.Module:
    """A headless torchvision model (fc = Identity), random init or a local file; never torchvision's hub."""
    import torchvision

    model = getattr(torchvision.models, spec.builder)(weights=None, **spec.kwargs)
    model.fc = nn.Identity()
    if path is not None:
        _load_strict(model, path, arch, cfg, drop_prefix=spec.classifier)
    return model


def _fedcore_vit(**kwargs: Any) -> nn.Module:
    """fedcore's timm-identical ViT (plain_vit.PlainViT) built from our kwargs, headless: no timm import."""
    return PlainViT(**kwargs, num_classes=0)


def _fedcore_resnet(**kwargs: Any) -> nn.Module:
    """fedcore's tiny headless ResNet."""
    return MiniResNet(**kwargs)


def _fedcore_stem_resnet(**kwargs: Any) -> nn.Module:
    """fedcore's headless ResNet with torchvision's stem and any number of stages (FedPFT)."""
    return StemResNet(**kwargs)


FEDCORE_BUILDERS: dict[str, Callable[..., nn.Module]] = {"PlainViT": _fedcore_vit,
                                                         "MiniResNet": _fedcore_resnet,
                                                         "StemResNet": _fedcore_stem_resnet}


def _build_fedcore(arch: str, spec: ArchSpec, path: Path | None, cfg: PretrainedCfg) -> nn.Module:
    """One of our tiny models; a local file is loaded strictly."""
    if spec.builder not in FEDCORE_BUILDERS:
        raise ValueError(f"arch {arch!r}: unknown fedcore builder {spec.builder!r}; known: {sorted(FEDCORE_BUILDERS)}")
    model = FEDCORE_BUILDERS[spec.builder](**spec.kwargs)
    if path is not None:
        _load_strict(model, path, arch, cfg, drop_prefix=spec.classifier)
    return model


def _build_open_clip(arch: str, spec: ArchSpec, path: Path | None, cfg: PretrainedCfg) -> nn.Module:
    """A whole open_clip model (image and text towers), random init or a local file; never a hub tag.

    ``kwargs = {"model_cfg": {...}}`` builds an unnamed config (embed_dim, vision_cfg, text_cfg) with the
    class open_clip's factory would pick; otherwise ``builder`` names an open_clip config (``ViT-B-16`` or
    one added with ``open_clip.add_model_config``) and kwargs go to ``open_clip.create_model``.
    """
    import open_clip

    kwargs = dict(spec.kwargs)
    if "model_cfg" in kwargs:
        model_cfg = copy.deepcopy(dict(kwargs.pop("model_cfg")))
        if kwargs:
            raise ValueError(f"arch {arch!r}: with model_cfg, put every setting inside it; got also {sorted(kwargs)}")
        custom = model_cfg.pop("custom_text", False) or "hf_model_name" in model_cfg.get("text_cfg", {})
        model = (open_clip.CustomTextCLIP if custom else open_clip.CLIP)(**model_cfg)
    else:
        if spec.builder not in open_clip.list_models():
            raise ValueError(f"arch {arch!r}: open_clip has no model config {spec.builder!r}")
        # torch's default device, as the other builders use (so `with torch.device("meta")` works here too)
        kwargs.setdefault("device", torch.get_default_device())
        model = open_clip.create_model(spec.builder, pretrained=None, **kwargs)
    if path is not None:
        try:
            # open_clip's loader: strict, and it adapts what its own checkpoints need (e.g. pos-embed resize)
            open_clip.load_checkpoint(model, str(path), strict=True)
        except (RuntimeError, KeyError, ValueError) as e:
            raise WeightFileError(f"{path} does not fit arch {arch} ({spec.builder}): {e}") from e
    return model


BUILDERS: dict[str, Callable[[str, ArchSpec, Path | None, PretrainedCfg], nn.Module]] = {
    "timm": _build_timm, "torchvision": _build_torchvision, "fedcore": _build_fedcore, "open_clip": _build_open_clip,
}


def _attach_cfg(model: nn.Module, arch: str, tag: str, cfg: PretrainedCfg) -> None:
    """Record the input contract on the model so that the model alone tells how to feed it."""
    pcfg = dict(getattr(model, "pretrained_cfg", None) or {})
    pcfg.update(architecture=arch, input_size=(3, cfg.img_size, cfg.img_size), mean=cfg.mean, std=cfg.std)
    model.pretrained_cfg = pcfg
    model.fedcore_arch = arch
    model.fedcore_tag = tag


def build_backbone(arch: str, weights: str | Path | None = None, tag: str | None = None,
                   input_size: int | None = None, sha256: str | None = None) -> nn.Module:
    """Build `arch` headless, loading `weights` from a local file (strictly) if given; never downloads.

    `tag` (default: the arch's default tag) picks the input contract recorded on the model
    (``model.pretrained_cfg``: input_size, mean, std), read back by ``backbone_info``/``input_cfg``, and the
    file's key layout (``PretrainedCfg.layout``).
    `input_size` replaces the weights' image size in that contract (families in ANY_INPUT_SIZE only): the run
    then feeds the same weights images of that side. `sha256`: the digest the file must have (``check_sha256``).
    """
    spec = arch_spec(arch)
    tag = spec.default_tag if tag is None else tag
    cfg = pretrained_cfg(arch, tag)
    if input_size is not None:
        if spec.family not in ANY_INPUT_SIZE:
            raise ValueError(f"input_size={input_size!r} for backbone arch {arch!r}: only families "
                             f"{list(ANY_INPUT_SIZE)} take another input size than their weights' ({cfg.img_size} "
                             f"px); a {spec.family}'s position embedding fixes its input size")
        if isinstance(input_size, bool) or not isinstance(input_size, int) or input_size < 1:
            raise ValueError(f"input_size for backbone arch {arch!r} must be an integer >= 1 (pixels), "
                             f"got {input_size!r}")
        cfg = replace(cfg, img_size=input_size)
    if sha256 is not None and weights is None:
        raise ValueError(f"a sha256 was given for arch {arch!r} but no weight file to check")
    path = None if weights is None else _check_file(arch, weights, cfg, sha256)
    model = BUILDERS[spec.source](arch, spec, path, cfg)
    if spec.family == "vit":
        built = model.patch_embed.img_size
        if int(built[0]) != cfg.img_size:  # a ViT's position embedding fixes its input size
            raise ValueError(f"{arch}.{tag} expects {cfg.img_size}-px inputs but {arch} is built for {built[0]} px")
    _attach_cfg(model, arch, tag, cfg)
    return model


# ---- built models -----------------------------------------------------------------------------------
def model_family(model: nn.Module) -> str:
    """The family (vit | resnet | clip) of a built backbone: from the registry if built here, else its type."""
    arch = getattr(model, "fedcore_arch", None)
    if arch in ARCH_SPECS:
        return ARCH_SPECS[arch].family
    if is_vit(model):
        return "vit"
    if resnet_stages(model):
        return "resnet"
    if hasattr(model, "encode_image") and hasattr(model, "encode_text"):
        return "clip"
    raise TypeError(f"{type(model).__name__} is not a backbone of a known family {FAMILIES}")


def model_facts(model: nn.Module) -> dict:
    """The static facts (family, depth, dim, patch_size) read off a built backbone (checks ARCH_SPECS)."""
    family = model_family(model)
    if family == "vit":
        return dict(family=family, depth=len(model.blocks), dim=int(model.embed_dim),
                    patch_size=int(model.patch_embed.patch_size[0]))
    if family == "resnet":
        return dict(family=family, depth=len(resnet_stages(model)), dim=resnet_feature_dim(model), patch_size=None)
    visual = model.visual
    patch = visual.patch_size if hasattr(visual, "patch_size") else None
    return dict(family=family, depth=len(visual.transformer.resblocks), dim=int(visual.output_dim),
                patch_size=None if patch is None else int(patch[0]))


def prompt_adapter(model: nn.Module) -> nn.Module:
    """The family's prompt adapter around a built backbone: PromptedViT (vit), PromptedResNet (resnet) or
    PromptedCLIP (clip: learnable text context, patch tokens for FedOTP's OT)."""
    family = model_family(model)
    if family == "vit":
        return PromptedViT(model)
    if family == "resnet":
        return PromptedResNet(model)
    return PromptedCLIP(model)
