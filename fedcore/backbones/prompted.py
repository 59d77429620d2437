"""A frozen ViT with prompt tokens inserted after the prefix (CLS) tokens at chosen blocks (VPT / SGPT).

The ViT is fedcore's PlainViT (mini scale) or timm's VisionTransformer (paper scale): same layout and names.
"""
from __future__ import annotations

import contextlib
import math
from typing import ContextManager, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

MODES = ("insert", "replace")


def attention_backend(device: torch.device | str) -> ContextManager:
    """SDPA backend context: the math kernel on CPU, torch's own (fused) choice elsewhere.

    At vit_mini's ~17-21 tokens the CPU flash kernel took ~30% of a training step; the math kernel made
    fwd+bwd ~25% faster on 2 cores. On GPU the fused kernels are the right choice.
    """
    return sdpa_kernel(SDPBackend.MATH) if torch.device(device).type == "cpu" else contextlib.nullcontext()


def init_prompts(n: int, dim: int, patch_size: int, generator: torch.Generator | None = None) -> nn.Parameter:
    """(n, dim) prompt tokens with VPT's init: uniform(-v, v), v = sqrt(6 / (3 * patch_size**2 + dim))."""
    v = math.sqrt(6.0 / (3 * patch_size * patch_size + dim))
    return nn.Parameter(torch.empty(n, dim).uniform_(-v, v, generator=generator))


class PromptedViT(nn.Module):
    """Wrap a ViT with timm's layout (frozen, always in eval mode) and run its blocks with prompt tokens."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = vit
        vit.requires_grad_(False)
        vit.eval()
        self.num_prefix_tokens = int(vit.num_prefix_tokens)
        self.embed_dim = int(vit.embed_dim)
        self.depth = len(vit.blocks)
        self.patch_size = int(vit.patch_embed.patch_size[0])

    @property
    def feature_dim(self) -> int:
        """Dim of the feature given to a head (the CLS token): embed_dim, named as on PromptedResNet."""
        return self.embed_dim

    def train(self, mode: bool = True) -> "PromptedViT":
        """Switch the wrapper's own modules; the backbone stays in eval mode (dropout off, as in SGPT's code)."""
        super().train(mode)
        self.vit.eval()
        return self

    @staticmethod
    def cls_token(tokens: Tensor) -> Tensor:
        """The CLS token output (B, D) of a forward_tokens result."""
        return tokens[:, 0]

    def _expand(self, p: Tensor, batch: int, block: int, like: Tensor) -> Tensor:
        """Shared (n,D) -> (B,n,D) view (no copy); per-sample (B,n,D) passes through after a shape check."""
        if p.ndim == 2:
            p = p.unsqueeze(0).expand(batch, -1, -1)
        elif p.ndim != 3 or p.shape[0] != batch:
            raise ValueError(f"prompts[{block}] must be (n, D) or (B={batch}, n, D), got {tuple(p.shape)}")
        if p.shape[-1] != self.embed_dim:
            raise ValueError(f"prompts[{block}] has dim {p.shape[-1]}, backbone embed_dim is {self.embed_dim}")
        # under autocast the residual stream may be fp32 while prompts are bf16 (or vice versa): match it
        return p.to(like.dtype)

    def embed(self, x: Tensor) -> Tensor:
        """Patch tokens with CLS and position embedding (B, 1+M, D): the input to block 0, no prompts.

        timm has no public name for this step (``forward_features`` runs it inline); ``_pos_embed`` is the
        only private timm piece fedcore uses (PlainViT keeps the name), and this is the only place that calls it.
        """
        v = self.vit
        return v.norm_pre(v.patch_drop(v._pos_embed(v.patch_embed(x))))

    def forward_tokens(
        self,
        x: Tensor,
        prompts: Mapping[int, Tensor] | None = None,
        mode: str = "insert",
        stop_block: int | None = None,
        collect: Sequence[int] | None = None,
    ) -> Tensor | dict[int, Tensor]:
        """Final-normed tokens (B, T, D) of model input `x` (B,3,S,S) with `prompts[i]` entering block i.

        mode="insert": new tokens go right after the prefix tokens and are kept (SGPT; VPT-shallow if only
        block 0). mode="replace": VPT-deep, the prompt outputs of the previous insertion are swapped for
        prompts[i]. stop_block=k runs blocks 0..k only, then the final norm. collect=[b, ...]: one pass to
        the deepest of them (or stop_block) returning {b: final-normed tokens after block b}.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        want = None if collect is None else sorted({int(b) for b in collect})
        if want is not None and not (want and 0 <= want[0] and want[-1] < self.depth):
            raise ValueError(f"collect must name blocks in [0, {self.depth - 1}], got {collect}")
        if stop_block is not None:
            last = int(stop_block)
        else:
            last = self.depth - 1 if want is None else want[-1]
        if not 0 <= last < self.depth:
            raise ValueError(f"stop_block must be in [0, {self.depth - 1}], got {stop_block}")
        if want is not None and want[-1] > last:
            raise ValueError(f"collect blocks {want} go past stop_block={last}")
        prompts = prompts or {}
        bad = [i for i in prompts if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"prompt blocks {bad} outside the backbone's blocks 0..{self.depth - 1}")

        v, npfx = self.vit, self.num_prefix_tokens
        h = self.embed(x)
        batch, n_live = h.shape[0], 0  # n_live: prompt tokens currently right after the prefix
        ckpt = v.grad_checkpointing and torch.is_grad_enabled()
        out: dict[int, Tensor] = {}
        for i in range(last + 1):
            p = prompts.get(i)
            if p is not None:
                p = self._expand(p, batch, i, h)
                keep_from = npfx + (n_live if mode == "replace" else 0)
                h = torch.cat([h[:, :npfx], p, h[:, keep_from:]], dim=1)
                n_live = p.shape[1] if mode == "replace" else n_live + p.shape[1]
            blk = v.blocks[i]
            h = checkpoint(blk, h, use_reentrant=False) if ckpt else blk(h)
            if want is not None and i in want:
                out[i] = v.norm(h)
        return v.norm(h) if want is None else out

    def cls_features(self, x: Tensor, blocks: Sequence[int], prompts: Mapping[int, Tensor] | None = None,
                     mode: str = "insert") -> dict[int, Tensor]:
        """{b: final-normed CLS token (B, D) after block b} for each of `blocks`, in one pass."""
        return {b: self.cls_token(t) for b, t in self.forward_tokens(x, prompts, mode, collect=blocks).items()}

    def forward(self, x: Tensor, prompts: Mapping[int, Tensor] | None = None, mode: str = "insert") -> Tensor:
        """CLS feature (B, D) of the prompted backbone."""
        return self.cls_token(self.forward_tokens(x, prompts, mode))
