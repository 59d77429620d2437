"""The official SGPT code (github.com/ubc-tea/SGPT) imported from a local checkout, for side-by-side checks.

Nothing of that repository is copied here: its ``models/vit_models_pr.py`` (``VisionTransformer_m``) and its
``utils.py`` (the local update ``train_local_twostage``, the server's ``group_ratio_func`` and
``aggregation_func``) are imported at run time from the checkout a caller names. Used by
``benchmarks/bench_sgpt_official.py`` (speed) and ``tests/test_official_sgpt.py`` (numerical equivalence). SGPT's
ViT is the VPT code's (github.com/KMnP/vpt), so ``tests/test_official_vpt.py`` maps our ViT onto VPT's with
``official_backbone_state`` and reads its configs through ``AttrDict`` and ``mini_config``.

The checkout's top-level module names are generic (``models``, ``utils``, ``datasets``, ``constants``), so they
are imported with the checkout first on ``sys.path`` and removed from ``sys.modules`` afterwards: another
package of the same name (e.g. Hugging Face ``datasets``) neither shadows them nor is shadowed by them.
``models/configs.py`` needs ``ml_collections``; where that package is missing a minimal attribute-dict stands in
(the configs only read attributes and items).
"""
from __future__ import annotations

import functools
import importlib
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from fedcore.official_code import checkout_on_path, standin_modules

#: top-level names the checkout's modules import by their bare name
_CHECKOUT_NAMES = ("models", "utils", "datasets", "constants", "ml_collections")


class AttrDict(dict):
    """What the official configs use of ml_collections.ConfigDict: items also as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = AttrDict(value) if isinstance(value, dict) and not isinstance(value, AttrDict) else value

    def __delattr__(self, name: str) -> None:
        del self[name]


def _import_from(checkout: Path, module: str) -> types.ModuleType:
    """``module`` imported with ``checkout`` first on sys.path; the checkout's bare names are unregistered after."""
    standins = {}
    try:
        importlib.import_module("ml_collections")
    except ImportError:
        standins = standin_modules({"ml_collections": {"ConfigDict": lambda d=None: AttrDict(d or {})}})
    with checkout_on_path(checkout, _CHECKOUT_NAMES, standins):
        return importlib.import_module(module)


def _checkout(checkout: str | Path) -> Path:
    """The checkout's resolved path, after checking it holds the official model."""
    path = Path(checkout).resolve()
    if not (path / "models" / "vit_models_pr.py").exists():
        raise FileNotFoundError(f"{path}: no models/vit_models_pr.py there (a checkout of ubc-tea/SGPT?)")
    return path


@functools.lru_cache(maxsize=None)
def official_module(checkout: str | Path) -> types.ModuleType:
    """The official ``models.vit_models_pr`` (``VisionTransformer_m``), imported once per checkout."""
    return _import_from(_checkout(checkout), "models.vit_models_pr")


@functools.lru_cache(maxsize=None)
def official_utils(checkout: str | Path) -> types.ModuleType:
    """The official ``utils`` (``train_local_twostage``, ``group_ratio_func``, ``aggregation_func``)."""
    return _import_from(_checkout(checkout), "utils")


def mini_config(dim: int, depth: int, heads: int, patch: int) -> AttrDict:
    """An official ViT config at the given width, depth, heads and patch (MLP 4 x dim, dropout 0)."""
    return AttrDict(patches=AttrDict(size=(patch, patch)), hidden_size=dim, classifier="token",
                    representation_size=None,
                    transformer=AttrDict(mlp_dim=4 * dim, num_heads=heads, num_layers=depth,
                                         attention_dropout_rate=0.0, dropout_rate=0.0))


def official_args(groups: int, shared: list[int], group: list[int], dataset: str = "cifar100", n_prompt: int = 1,
                  device: torch.device | str = "cpu") -> SimpleNamespace:
    """The argparse fields ``VisionTransformer_m`` reads (main_prompt.py's names)."""
    return SimpleNamespace(key_prompt=groups, share_blocks=list(shared), share_blocks_g=list(group),
                           n_prompt=n_prompt, device=torch.device(device), domain_query=False, dataset=dataset)


def official_model(vmp: types.ModuleType, config: Any, side: int, classes: int, args: SimpleNamespace) -> nn.Module:
    """The official VisionTransformer_m (random weights, backbone frozen as its ``freeze()`` does)."""
    model = vmp.VisionTransformer_m(config, side, num_classes=classes, args=args)
    model.freeze()
    return model


def official_backbone_state(vit: nn.Module, prefix: str = "transformer.") -> dict[str, Tensor]:
    """Our frozen ViT's tensors (timm layout) under the official ViT's names (the VPT code's ``Transformer``, which
    SGPT's ``VisionTransformer_m`` and VPT's ``PromptedTransformer`` share), each name under ``prefix``.

    patch_embed.proj -> embeddings.patch_embeddings, cls_token -> embeddings.cls_token, pos_embed ->
    embeddings.position_embeddings, blocks.i.norm1 / norm2 -> encoder.layer.i.attention_norm / ffn_norm, the fused
    attn.qkv (rows q, k, v) -> attn.query / key / value, attn.proj -> attn.out, mlp.fc1 / fc2 -> ffn.fc1 / fc2,
    norm -> encoder.encoder_norm.
    """
    out: dict[str, Tensor] = {}
    emb, enc = prefix + "embeddings.", prefix + "encoder."
    out[emb + "patch_embeddings.weight"] = vit.patch_embed.proj.weight
    out[emb + "patch_embeddings.bias"] = vit.patch_embed.proj.bias
    out[emb + "cls_token"] = vit.cls_token
    out[emb + "position_embeddings"] = vit.pos_embed
    for i, blk in enumerate(vit.blocks):
        pre = f"{enc}layer.{i}."
        for ours, theirs in ((blk.norm1, "attention_norm"), (blk.norm2, "ffn_norm"), (blk.attn.proj, "attn.out"),
                             (blk.mlp.fc1, "ffn.fc1"), (blk.mlp.fc2, "ffn.fc2")):
            out[f"{pre}{theirs}.weight"], out[f"{pre}{theirs}.bias"] = ours.weight, ours.bias
        for part, w, b in zip(("query", "key", "value"), blk.attn.qkv.weight.chunk(3), blk.attn.qkv.bias.chunk(3)):
            out[f"{pre}attn.{part}.weight"], out[f"{pre}attn.{part}.bias"] = w, b
    out[enc + "encoder_norm.weight"], out[enc + "encoder_norm.bias"] = vit.norm.weight, vit.norm.bias
    return {k: v.detach().clone() for k, v in out.items()}


def official_state(model: nn.Module) -> dict[str, Tensor]:
    """Our SGPTModel's tensors under the official VisionTransformer_m's names and shapes (a full state dict).

    Backbone: ``official_backbone_state`` under ``transformer.``. SGPT's tensors: shared.j (n, D) ->
    prompt_common.j (1, n, D); group.j (G, D) -> prompt_embeddings.j.g (1, 1, D) for each group g; keys ->
    prompt_keys; head -> head.
    """
    out = official_backbone_state(model.backbone.vit)
    for j, p in enumerate(model.shared):
        out[f"prompt_common.{j}"] = p.unsqueeze(0)
    for j, table in enumerate(model.group):
        for g in range(table.shape[0]):
            out[f"prompt_embeddings.{j}.{g}"] = table[g].reshape(1, 1, -1)
    out["prompt_keys"] = model.keys
    out["head.weight"], out["head.bias"] = model.head.weight, model.head.bias
    return {k: v.detach().clone() for k, v in out.items()}


__all__ = ["AttrDict", "mini_config", "official_args", "official_backbone_state", "official_model", "official_module",
           "official_state", "official_utils"]
