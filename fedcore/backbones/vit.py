"""ViT entry points kept for the code that calls them: thin wrappers over fedcore.backbones.registry."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, MutableMapping

from torch import nn

from fedcore.backbones.plain_vit import is_vit
from fedcore.backbones.registry import (
    ARCH_SPECS,
    IN21K_NORM,
    ArchSpec,
    PretrainedCfg,
    arch_spec,
    build_backbone,
    input_cfg,
    model_facts,
    model_family,
    register_arch,
    split_tag,
)

_IN21K = IN21K_NORM


class _VitArchs(MutableMapping):
    """The registry's ViT archs in the old ``ARCHS`` shape: {kwargs | timm, img_size, patch_size, mean, std}.

    Reading gives a copy (the registry is not edited through it). Assigning an entry of that shape
    registers (or replaces) a ViT arch whose builder reads the assigned ``kwargs`` dict at build time, so
    ``ARCHS[a] = cfg = deepcopy(ARCHS[a]); cfg["kwargs"]["mlp_ratio"] = 2`` still changes what is built
    (benchmarks/bench_pretrain.py explores this way).
    """

    def __getitem__(self, arch: str) -> dict:
        spec = ARCH_SPECS.get(arch)
        if spec is None or spec.family != "vit":
            raise KeyError(arch)
        builder = dict(kwargs=dict(spec.kwargs)) if spec.source == "fedcore" else dict(timm=spec.builder)
        return dict(**builder, patch_size=spec.patch_size, **input_cfg(arch))

    def __setitem__(self, arch: str, cfg: dict) -> None:
        if "kwargs" in cfg:
            kw = cfg["kwargs"]
            spec = ArchSpec("vit", "fedcore", "PlainViT", kw, depth=kw["depth"], dim=kw["embed_dim"],
                            patch_size=kw["patch_size"], default_tag="default")
        else:
            old = next((s for s in ARCH_SPECS.values() if s.source == "timm" and s.builder == cfg["timm"]), None)
            if old is None:
                raise ValueError(f"unknown timm ViT {cfg['timm']!r}: register it with registry.register_arch")
            spec = ArchSpec("vit", "timm", cfg["timm"], {}, depth=old.depth, dim=old.dim, patch_size=old.patch_size,
                            default_tag="default")
        tags = {"default": PretrainedCfg(int(cfg["img_size"]), tuple(cfg["mean"]), tuple(cfg["std"]))}
        register_arch(arch, spec, tags, replace=True)

    def __delitem__(self, arch: str) -> None:
        self[arch]  # KeyError unless a ViT arch
        del ARCH_SPECS[arch]

    def __iter__(self) -> Iterator[str]:
        return iter([a for a, s in ARCH_SPECS.items() if s.family == "vit"])

    def __len__(self) -> int:
        return sum(1 for _ in self)


ARCHS: MutableMapping[str, dict] = _VitArchs()


def build_vit(arch: str, weights: str | Path | None = None) -> nn.Module:
    """Build a headless (num_classes=0) ViT for `arch` ('arch' or 'arch.tag'), loading `weights` from a local
    file; never downloads."""
    name, tag = split_tag(arch)
    family = arch_spec(name).family
    if family != "vit":
        raise ValueError(f"arch {arch!r} is a {family} backbone, not a ViT: use registry.build_backbone")
    return build_backbone(name, weights, tag)


def backbone_info(model: nn.Module) -> dict:
    """Shape and input facts of a built backbone.

    ViT: embed_dim, depth, img_size, patch_size, mean, std, num_prefix_tokens (as always). Other families:
    embed_dim (the pooled feature dim), depth (stages or blocks), img_size, mean, std.
    """
    pcfg = getattr(model, "pretrained_cfg", None) or {}
    if is_vit(model):
        img_size = model.patch_embed.img_size
        return dict(
            embed_dim=int(model.embed_dim),
            depth=len(model.blocks),
            img_size=int(img_size[0] if isinstance(img_size, (tuple, list)) else img_size),
            patch_size=int(model.patch_embed.patch_size[0]),
            mean=tuple(pcfg.get("mean", _IN21K["mean"])),
            std=tuple(pcfg.get("std", _IN21K["std"])),
            num_prefix_tokens=int(model.num_prefix_tokens),
        )
    if "input_size" not in pcfg:
        raise ValueError(f"{type(model).__name__} carries no input contract: build it with registry.build_backbone")
    facts = model_facts(model)
    return dict(embed_dim=facts["dim"], depth=facts["depth"], img_size=int(pcfg["input_size"][-1]),
                mean=tuple(pcfg["mean"]), std=tuple(pcfg["std"]), family=model_family(model))
