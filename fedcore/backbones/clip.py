"""A frozen open_clip CLIP with learnable text context (CoOp) and per-patch image tokens (FedOTP; fedotp §1.2-1.3).

``PromptedCLIP`` is the ``clip`` family's prompt adapter (``registry.prompt_adapter``). Nothing of the CLIP is
trained: methods own the context vectors and pass them in. Its API, which the FedOTP methods code against:

* ``encode_image_tokens(x)``: (B, 1+M, embed_dim), CLS then the M patch tokens, each after ``ln_post`` and
  ``@ proj`` (what FedOTP's modified CLIP returns), not normalised;
* ``tokenize_classnames(names, n_ctx)``: ids of ``"X X ... X {name}."`` (n_ctx placeholders) and EOT positions;
* ``token_embedding(ids)``: the frozen token embeddings;
* ``encode_text_with_context(ctx, ids, eot)``: (P, K, embed_dim) text features of P unified contexts
  (CSC=False) for K class names, differentiable w.r.t. ``ctx``, in one transformer call over P*K sequences;
* ``encode_text(texts)``: hand-written prompts (zero-shot CLIP);
* ``logit_scale``: exp of the model's learned logit scale (100 for OpenAI CLIP).

Text sequences are cut after the longest EOT before the transformer: with CLIP's causal mask no position
attends to a later one, so the EOT features are the same (spec official_code B6 item 2: ~20 of 77 tokens).
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor, nn

PLACEHOLDER = "X"  # CoOp's context placeholder token, replaced by the learnable vectors


@lru_cache(maxsize=8)
def clip_tokenizer(context_length: int):
    """open_clip's bundled BPE tokenizer (offline) for sequences of `context_length` tokens."""
    from open_clip.tokenizer import SimpleTokenizer

    return SimpleTokenizer(context_length=context_length)


def tokenize(texts: list[str], context_length: int) -> Tensor:
    """Token ids (N, context_length) of `texts`; a ValueError names any text that would be cut (no EOT)."""
    tok = clip_tokenizer(context_length)
    too_long = [t for t in texts if len(tok.encode(t)) + 2 > context_length]  # + SOS and EOT
    if too_long:
        raise ValueError(f"{len(too_long)} prompts do not fit the text encoder's {context_length} tokens, e.g. "
                         f"{too_long[0]!r}: shorten the class names or n_ctx")
    return tok(texts)


def encode_embedded_text(clip: nn.Module, x: Tensor, eot: Tensor) -> Tensor:
    """CLIP's text encoder from embedded sequences x (N, L, W): + positions, causal mask, ln_final, EOT @ proj.

    L may be shorter than the context length (cut after the last EOT): the causal mask is cut alike.
    """
    length = x.shape[1]
    x = x + clip.positional_embedding[:length].to(x.dtype)
    mask = clip.attn_mask
    x = clip.transformer(x, attn_mask=None if mask is None else mask[:length, :length])
    x = clip.ln_final(x)
    x = x[torch.arange(x.shape[0], device=x.device), eot.to(x.device)]
    proj = clip.text_projection
    if proj is None:
        return x
    return proj(x) if isinstance(proj, nn.Linear) else x @ proj


def encode_token_ids(clip: nn.Module, ids: Tensor) -> Tensor:
    """CLIP's encode_text (unnormalised) of token ids (N, context_length), cut after the last EOT first."""
    ids = ids.to(clip.token_embedding.weight.device)
    eot = ids.argmax(dim=-1)
    length = int(eot.max()) + 1
    return encode_embedded_text(clip, clip.token_embedding(ids[:, :length]), eot)


def clip_classnames(meta: dict) -> list[str]:
    """The class names a CLIP prompt uses for a dataset: meta["clip_names"] where the bundle has them (the
    embedded digits: "zero" .. "nine"), else its meta["classes"]."""
    return list(meta.get("clip_names", meta["classes"]))


def text_length(eot: Tensor) -> int:
    """Tokens up to the last EOT of ``eot`` (positions): with CLIP's causal mask the positions after it change nothing
    before it, so the text tower runs on the ids cut there."""
    return int(eot.max()) + 1


class PromptedCLIP(nn.Module):
    """Wrap an open_clip ``CLIP`` (frozen, always in eval mode): patch tokens and CoOp-style prompted text."""

    def __init__(self, clip: nn.Module) -> None:
        super().__init__()
        import open_clip

        if type(clip) is not open_clip.CLIP:
            raise TypeError(f"PromptedCLIP wraps an open_clip CLIP (text tower on the model), got "
                            f"{type(clip).__name__}")
        visual = clip.visual
        if not isinstance(visual, open_clip.transformer.VisionTransformer):
            raise TypeError(f"PromptedCLIP needs a ViT image tower for patch tokens, got {type(visual).__name__}")
        if visual.attn_pool is not None or visual.final_ln_after_pool or visual.pool_type != "tok":
            raise ValueError("PromptedCLIP needs CLIP's own pooling (CLS token, ln_post on every token, no "
                             "attentional pool) so that CLS and patches come out alike")
        if clip.text_pool_type != "argmax":
            raise ValueError(f"PromptedCLIP pools text at the EOT (argmax) token; this model pools "
                             f"{clip.text_pool_type!r}")
        self.clip = clip
        clip.requires_grad_(False)
        clip.eval()
        self.embed_dim = int(visual.output_dim)
        self.text_width = int(clip.token_embedding.embedding_dim)
        self.context_length = int(clip.context_length)
        self.img_size = int(visual.image_size[0])
        self.patch_size = int(visual.patch_size[0])
        self.num_patches = int(visual.grid_size[0] * visual.grid_size[1])
        self.vocab_size = int(clip.vocab_size)

    @property
    def feature_dim(self) -> int:
        """The joint image-text dim (embed_dim), named as on the other adapters."""
        return self.embed_dim

    @property
    def logit_scale(self) -> float:
        """exp of the model's logit scale: CLIP's inverse softmax temperature (100 for OpenAI CLIP)."""
        # read once per value of the (frozen) parameter: every training step asks, and on CUDA each read is a sync
        t = self.clip.logit_scale
        key = (id(t), t.data_ptr(), t._version, t.device)
        cached = self.__dict__.get("_logit_scale")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_logit_scale"] = (key, float(t.detach().exp()))
        return cached[1]

    def train(self, mode: bool = True) -> "PromptedCLIP":
        """The CLIP stays in eval mode whatever the mode (frozen backbone)."""
        super().train(mode)
        self.clip.eval()
        return self

    # ---- image side ---------------------------------------------------------------------------------
    def encode_image_tokens(self, x: Tensor) -> Tensor:
        """(B, 1+M, embed_dim) float32: CLS then the M patch tokens, each after ln_post and @ proj, unnormalised."""
        visual = self.clip.visual
        visual.output_tokens = True  # open_clip's public way to get the tokens (after ln_post, unprojected)
        try:
            pooled, tokens = visual(x)
        finally:
            visual.output_tokens = False
        return torch.cat([pooled.unsqueeze(1), tokens @ visual.proj], dim=1).float()

    # ---- text side ----------------------------------------------------------------------------------
    def tokenize_classnames(self, classnames: list[str], n_ctx: int) -> tuple[Tensor, Tensor]:
        """Ids (K, context_length) of "X X ... X {name}." (n_ctx placeholders, "_" -> " ") and EOT positions (K,)."""
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        prefix = " ".join([PLACEHOLDER] * n_ctx)
        texts = [f"{prefix} {name.replace('_', ' ')}." for name in classnames]
        ids = self._tokenize(texts)
        placeholder = clip_tokenizer(self.context_length).encode(PLACEHOLDER)
        if len(placeholder) != 1 or not bool((ids[:, 1 : 1 + n_ctx] == placeholder[0]).all()):
            raise AssertionError("the tokenizer did not map each context placeholder to one token")
        return ids, ids.argmax(dim=-1)

    def token_embedding(self, ids: Tensor) -> Tensor:
        """The frozen token embeddings (..., text_width) of token ids."""
        return self.clip.token_embedding(ids)

    def encode_text_with_context(self, ctx: Tensor, ids: Tensor, eot: Tensor, length: int | None = None) -> Tensor:
        """(P, K, embed_dim) unnormalised text features of P unified contexts ctx (P, n_ctx, text_width) for the
        K prompts `ids`/`eot` of ``tokenize_classnames`` (same n_ctx): [SOS] + ctx + class tokens + [EOT].
        ``length``: ``text_length(eot)`` where the caller knows it (else read from ``eot``: a sync on CUDA)."""
        if ctx.ndim != 3 or ctx.shape[-1] != self.text_width:
            raise ValueError(f"ctx must be (P, n_ctx, {self.text_width}), got {tuple(ctx.shape)}")
        if ids.ndim != 2 or eot.shape != ids.shape[:1]:
            raise ValueError(f"ids must be (K, L) and eot (K,), got {tuple(ids.shape)} and {tuple(eot.shape)}")
        p, n_ctx, _ = ctx.shape
        k = ids.shape[0]
        if length is None:
            length = text_length(eot)
        emb = self.token_embedding(ids[:, :length].to(self.clip.token_embedding.weight.device))  # (K, L, W)
        ctx = ctx.to(emb.dtype)
        x = torch.cat([emb[:, :1].expand(p, k, 1, -1), ctx.unsqueeze(1).expand(p, k, n_ctx, -1),
                       emb[:, 1 + n_ctx :].expand(p, k, -1, -1)], dim=2)
        feats = encode_embedded_text(self.clip, x.reshape(p * k, length, self.text_width), eot.repeat(p))
        return feats.view(p, k, -1)

    def encode_text(self, texts: list[str]) -> Tensor:
        """(len(texts), embed_dim) unnormalised features of hand-written prompts (zero-shot CLIP)."""
        return encode_token_ids(self.clip, self._tokenize(texts))

    def _tokenize(self, texts: list[str]) -> Tensor:
        """Ids of `texts` at the model's context length, checked against its vocabulary."""
        ids = tokenize(texts, self.context_length)
        if int(ids.max()) >= self.vocab_size:
            raise ValueError(f"the CLIP's vocabulary has {self.vocab_size} tokens, the BPE tokenizer needs 49408")
        return ids
