"""ViT backbones as data plus one builder: timm architectures (local weight files only) and the tiny `vit_mini`."""
from __future__ import annotations

from pathlib import Path

import timm
import torch
from timm.models.vision_transformer import VisionTransformer

_IN21K = dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))  # Google in21k ViTs are trained on [-1, 1] inputs

# Every backbone the pipeline knows. `timm` names a timm architecture; `kwargs` builds a VisionTransformer
# directly (no timm registry entry, no pretrained config). img_size/mean/std define the model input.
ARCHS: dict[str, dict] = {
    # 16 patches + CLS, ~200k params: fwd+bwd ~2,800 img/s on 2 CPU cores (benchmarks/bench_pretrain.py).
    # mlp_ratio 4 keeps the standard ViT block shape; 2 was only ~20% faster and 4 clears the 1,000 img/s
    # target almost threefold.
    "vit_mini": dict(
        kwargs=dict(img_size=16, patch_size=4, embed_dim=64, depth=4, num_heads=4, mlp_ratio=4.0),
        img_size=16, patch_size=4, **_IN21K,
    ),
    "vit_small_patch16_224": dict(timm="vit_small_patch16_224", img_size=224, patch_size=16, **_IN21K),
    "vit_base_patch16_224": dict(timm="vit_base_patch16_224", img_size=224, patch_size=16, **_IN21K),
    "vit_large_patch16_224": dict(timm="vit_large_patch16_224", img_size=224, patch_size=16, **_IN21K),
}


def _arch_cfg(arch: str) -> dict:
    """The ARCHS entry for `arch`, or a ValueError listing the known ones."""
    if arch not in ARCHS:
        raise ValueError(f"unknown backbone arch {arch!r}; known archs: {sorted(ARCHS)}")
    return ARCHS[arch]


def _check_file(arch: str, weights: str | Path) -> Path:
    """Fail early, and say what to fix, when a configured weight file is absent."""
    path = Path(weights)
    if not path.is_file():
        raise FileNotFoundError(
            f"weight file {str(path)!r} for backbone arch {arch!r} does not exist: fix the `weights:` key of "
            f"the backbone with `arch: {arch}` in config/backbones.yaml, or put the file there "
            f"(vit_mini weights are written by the pipeline's pretrain rule)"
        )
    return path


def _read_state_dict(path: Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Load a safetensors or torch state dict, unwrapping a {'state_dict'|'model': ...} checkpoint."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(path))
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    for key in ("state_dict", "model"):
        if isinstance(sd.get(key), dict):
            sd = sd[key]
    return {k.removeprefix("module."): v for k, v in sd.items()}


def _file_keys(path: Path) -> set[str]:
    """Parameter names stored in a weight file, read without loading tensors where the format allows."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {k.removeprefix("module.") for k in f.keys()}
    return set(_read_state_dict(path, mmap=True))


def _attach_cfg(model: VisionTransformer, arch: str, cfg: dict) -> None:
    """Record the input contract on the model so backbone_info needs only the model."""
    pcfg = dict(getattr(model, "pretrained_cfg", None) or {})
    pcfg.update(architecture=arch, input_size=(3, cfg["img_size"], cfg["img_size"]), mean=cfg["mean"], std=cfg["std"])
    model.pretrained_cfg = pcfg
    model.fedcore_arch = arch


def build_vit(arch: str, weights: str | Path | None = None) -> VisionTransformer:
    """Build a headless (num_classes=0) ViT for `arch`, loading `weights` from a local file; never downloads."""
    cfg = _arch_cfg(arch)
    path = None if weights is None else _check_file(arch, weights)
    if "kwargs" in cfg:
        model = VisionTransformer(**cfg["kwargs"], num_classes=0)
        if path is not None:
            model.load_state_dict(_read_state_dict(path), strict=True)
    else:
        overlay = dict(mean=cfg["mean"], std=cfg["std"])
        if path is not None:
            # custom_load only for Google's JAX .npz; explicit so that older timm cannot route a torch file there
            overlay.update(file=str(path), custom_load=str(path).endswith(".npz"))
        model = timm.create_model(
            cfg["timm"], pretrained=path is not None, num_classes=0, pretrained_cfg_overlay=overlay
        )
        if path is not None and not str(path).endswith(".npz"):
            # timm loads non-strictly once it drops the classifier: make a wrong file an error, not random weights
            missing = sorted(set(model.state_dict()) - _file_keys(path))
            if missing:
                raise ValueError(
                    f"{path} is not a {cfg['timm']} state dict: {len(missing)} backbone tensors missing, "
                    f"e.g. {missing[:5]}"
                )
    _attach_cfg(model, arch, cfg)
    return model


def backbone_info(model: VisionTransformer) -> dict:
    """Shape and input facts of a built ViT: embed_dim, depth, img_size, mean, std, num_prefix_tokens."""
    pcfg = getattr(model, "pretrained_cfg", None) or {}
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
