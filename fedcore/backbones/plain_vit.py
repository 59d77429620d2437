"""The mini-scale ViT without timm: timm's ``VisionTransformer`` at its default settings, written out.

Why: importing timm costs a job ~2.4 s of CPU before its first step (timm.layers imports torchvision.ops,
which imports torch._dynamo), about as much as ``import torch`` itself, and the mini-scale jobs use none of it.
``PlainViT`` has timm's parameter names, construction order, initialisation (the same random draws in the
same order) and arithmetic, so a seed gives the same weights and a weight file loads in either class;
``tests/test_plain_vit.py`` checks it against timm bit for bit. Paper-scale ViTs still come from timm.

Covered: class token, learned position embedding, pre-norm blocks with fused QKV attention (SDPA) and a GELU
MLP, final LayerNorm, token pooling, no dropout, no layer scale, no registers: what timm builds from
``VisionTransformer(img_size, patch_size, embed_dim, depth, num_heads, mlp_ratio, num_classes)``.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

LN_EPS = 1e-6  # timm's LayerNorm default (torch's is 1e-5)


def trunc_normal_(t: Tensor, std: float, a: float = -2.0, b: float = 2.0) -> Tensor:
    """Fill `t` with N(0, std^2) truncated to [a, b] by the inverse CDF, timm's method (one uniform draw per
    element). torch's own ``nn.init.trunc_normal_`` now rejection-samples: other draws, other weights."""
    cdf = lambda v: (1.0 + math.erf(v / math.sqrt(2.0))) / 2.0  # noqa: E731
    with torch.no_grad():
        t.uniform_(2 * cdf(a / std) - 1, 2 * cdf(b / std) - 1).erfinv_().mul_(std * math.sqrt(2.0))
        return t.clamp_(min=a, max=b)


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> patch tokens (B, N, D) by a stride-`patch_size` convolution."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.img_size, self.patch_size = _pair(img_size), _pair(patch_size)
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, x: Tensor) -> Tensor:
        """Patch tokens, after checking the input size the position embedding was built for."""
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"input is {tuple(x.shape[-2:])} px; this ViT is built for {self.img_size}")
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with one QKV projection, computed by scaled_dot_product_attention."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """(B, N, D) -> (B, N, D)."""
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    """Linear -> GELU -> Linear."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        """(…, D) -> (…, D)."""
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor) -> Tensor:
        """(B, N, D) -> (B, N, D)."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PlainViT(nn.Module):
    """A headless-or-headed ViT with timm's names and numbers (see the module docstring)."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 0,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.embed_dim = self.num_features = embed_dim
        self.num_prefix_tokens = 1
        self.grad_checkpointing = False
        # Construction order matters: each module's default init draws from the global generator, as in timm.
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.empty(1, self.patch_embed.num_patches + 1, embed_dim))
        self.patch_drop = nn.Identity()  # timm's names for steps that are identities at these settings
        self.norm_pre = nn.Identity()
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=LN_EPS)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        """timm's default ('') scheme: trunc-normal position embedding and Linear weights, zero biases."""
        trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        # timm applies this post-order (children first); Linear layers are leaves, so they are reached in
        # registration order either way, and only their draws touch the generator.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass (memory for time), as timm's flag does."""
        self.grad_checkpointing = enable

    def _pos_embed(self, x: Tensor) -> Tensor:
        """Prepend the CLS token and add the position embedding (timm's name for this step)."""
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed

    def forward_features(self, x: Tensor) -> Tensor:
        """Final-normed tokens (B, 1+N, D)."""
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.grad_checkpointing and torch.is_grad_enabled() \
                else blk(x)
        return self.norm(x)

    def forward(self, x: Tensor) -> Tensor:
        """The CLS token through the head (the pooled (B, D) feature when headless)."""
        return self.head(self.forward_features(x)[:, 0])


def is_vit(model: nn.Module) -> bool:
    """True for a PlainViT or a timm VisionTransformer (checked without importing timm: if timm is not
    loaded, no model can be one of its ViTs)."""
    if isinstance(model, PlainViT):
        return True
    vt = sys.modules.get("timm.models.vision_transformer")
    return vt is not None and isinstance(model, vt.VisionTransformer)
