"""What the CLIP prompt methods share (FedOTP, CoOp, PromptFL, PromptFL+FedProx, zero-shot CLIP; spec fedotp §1.2,
§4): learnable CoOp text contexts over a frozen ``PromptedCLIP``, scored on the cached image tokens.

The image tower is frozen, so each image's tokens (CLS + M patches, artifact ``clip_tokens``) are computed once by
rule ``features`` and every batch carries them as ``batch.extras[TOKENS]``: no image is encoded during training or
evaluation. A model holds one or more unified contexts (CSC=False), each a Parameter (n_ctx, text_width) named by
the method (``ctx_global``/``ctx_local`` for FedOTP, ``ctx`` otherwise), drawn together from N(0, 0.02^2) as the
official code's one (N, n_ctx, width) tensor, once per run: every client starts from the same draw.

Choices (DEVIATIONS.md, FedOTP): image tokens of the deterministic transform (InputPipeline resize + normalise)
only, where the official code trains on random-resized crops and flips (the cache needs one view per image); the
logit scale is the backbone's own (exp of CLIP's logit_scale: 100 for OpenAI CLIP, as the code); similarities and
everything after them run in fp32 even under bf16 autocast (spec §1.1: the OT's cost in fp32).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.clip import text_length
from fedcore.constraints import Flag, Int
from fedcore.engine.batching import OnePass, OnePassEval, epochs_of_loss
from fedcore.engine.data import Batch
from fedcore.engine.onepass import Owners, batch_invariant, tensor_key
from fedcore.engine.optim import autocast_for
from fedcore.engine.roles import Client, Evaluator, Method, Payload, RoundInfo, Strategy, Together

TOKENS = "clip_tokens"  # batch extras name (and artifact key) of the frozen CLIP image tokens
CTX_STD = 0.02          # CoOp's random context init, N(0, 0.02^2)


def image_tokens(batch: Batch) -> Tensor:
    """The batch's cached CLIP image tokens (B, 1+M, D) as float32 (stored float16)."""
    if TOKENS not in batch.extras:
        raise KeyError(f"the batch carries no {TOKENS!r} extras: CLIP prompt methods read the cached image tokens "
                       f"(artifact {TOKENS}, rule features); got extras {sorted(batch.extras)}")
    return batch.extras[TOKENS].float()


def fp32(x: Tensor) -> torch.autocast:
    """A block without autocast, so that similarities, the OT and the logits stay fp32 on CUDA too."""
    return torch.autocast(x.device.type, enabled=False)


def cls_logits(tokens: Tensor, text: Tensor, scale: float) -> Tensor:
    """CLIP's zero-shot score: scale * cos(CLS token, text feature of each class); text (K, D) normalised."""
    return scale * F.normalize(tokens[:, 0].float(), dim=-1) @ text.float().t()


class ContextPrompts(nn.Module):
    """Frozen PromptedCLIP + named learnable contexts; ``forward(tokens)``: CLS cosine with the mean of the prompts'
    normalised text features (one prompt: CoOp / PromptFL). Subclasses score otherwise (FedOTP's OT)."""

    def __init__(self, clip: nn.Module, class_names: list[str], n_ctx: int, names: tuple[str, ...]) -> None:
        super().__init__()
        self.clip = clip
        self.names = tuple(names)
        ids, eot = clip.tokenize_classnames(list(class_names), int(n_ctx))
        self.register_buffer("token_ids", ids, persistent=False)
        self.register_buffer("token_eot", eot, persistent=False)
        # read here, on the CPU, not from the device buffer at every text pass (a sync per training step on CUDA)
        self.text_length = text_length(eot)
        init = torch.randn(len(names), int(n_ctx), clip.text_width) * CTX_STD  # one draw, as the code's one tensor
        for name, row in zip(names, init, strict=True):
            self.register_parameter(name, nn.Parameter(row.clone()))

    @property
    def logit_scale(self) -> float:
        """CLIP's inverse temperature (exp of its logit scale)."""
        return self.clip.logit_scale

    def contexts(self) -> Tensor:
        """(P, n_ctx, text_width): the prompts in ``names`` order."""
        return torch.stack([getattr(self, n) for n in self.names])

    def client_text_features(self, owners: Owners) -> list[Tensor]:
        """One pass (each context stacked per client): each segment's client's (P, K, D) ``text_features``, all the
        clients' P x K prompts through the text tower in one call; at evaluation once per group of clients, not per
        test batch (``batch_invariant``)."""
        stacked = [getattr(self, n) for n in self.names]
        return batch_invariant(("client_text", id(self), owners.rows, tensor_key(*stacked)),
                               lambda: self._client_text_features(owners))

    def _client_text_features(self, owners: Owners) -> list[Tensor]:
        """``client_text_features`` computed."""
        rows = [torch.stack(parts) for parts in zip(*(owners.of(getattr(self, n)) for n in self.names))]
        feats = self.clip.encode_text_with_context(torch.cat(rows), self.token_ids, self.token_eot, self.text_length)
        # normalised per client, as its one-by-one update does: the gradient that reaches each normalisation then has
        # the layout it has there (its reductions' order depends on it)
        out = []
        for f in feats.split(len(self.names)):
            with fp32(f):
                out.append(F.normalize(f.float(), dim=-1))
        return out

    def text_features(self) -> Tensor:
        """(P, K, D) normalised fp32 text features of every prompt for every class; at evaluation once per loaded
        context for the whole split (``batch_invariant``), not once per batch."""
        params = [getattr(self, n) for n in self.names]
        return batch_invariant(("text", id(self), tensor_key(*params)), self._text_features)

    def _text_features(self) -> Tensor:
        """``text_features`` computed."""
        feats = self.clip.encode_text_with_context(self.contexts(), self.token_ids, self.token_eot,
                                                  self.text_length)
        with fp32(feats):
            return F.normalize(feats.float(), dim=-1)

    def forward(self, tokens: Tensor, owners: Owners | None = None) -> Tensor:
        """Logits (B, K): CLS cosine with the (mean) prompt text feature, times CLIP's scale (``owners``: one pass,
        each segment with its own client's prompts)."""
        if owners is not None:
            return torch.cat([self.forward_text(t, text) for t, text in
                              zip(owners.split(tokens), self.client_text_features(owners))])
        return self.forward_text(tokens, self.text_features())

    def forward_text(self, tokens: Tensor, text: Tensor) -> Tensor:
        """Logits of the tokens (B, 1+M, D) against the prompts' text features ``text`` (P, K, D)."""
        with fp32(text):
            return cls_logits(tokens, text.mean(0), self.logit_scale)


class ClipClient(Client):
    """Trains its contexts with CE on the cached tokens; sends the method's shared prompts, keeps its local ones."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The method's shared prompts (nothing else of the model: the token buffers are the run's constants)."""
        return [k for k in keys if k in self.method.shared_prompts]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The method's other prompts stay with the client."""
        return [k for k in keys if k in self.method.prompt_names and k not in self.method.shared_prompts]

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """CE over all the dataset's classes (spec §1.2: also where a client holds only some)."""
        return F.cross_entropy(model(image_tokens(batch)), batch.y)

    def client_losses(self, model: nn.Module, batch: Batch, owners: Owners) -> Tensor:
        """Each client's ``loss`` on its segment of a concatenated batch, with its own contexts (one pass)."""
        return owners.per_client(F.cross_entropy, model(image_tokens(batch), owners), batch.y)

    def together(self, device: str, model: nn.Module) -> Together:
        """The round's contexts in one pass: every client's prompts through the text tower in one call per step."""
        return epochs_of_loss(self, device, model, vmap=False,
                              one_pass=OnePass(self.client_losses, per_client=self.method.prompt_names))


class ClipEvaluator(Evaluator):
    """Scores the global prompts (PromptFL, zero-shot) on the cached image tokens."""

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> Tensor:
        """Logits of the batch's tokens."""
        with autocast_for(batch.x):
            return model(image_tokens(batch)).float()


class PersonalClipEvaluator(ClipEvaluator):
    """Each client scored with its own prompts (the downlink's, then its personal ones) on its own test split."""

    personalized = True

    def one_pass(self, model: nn.Module) -> OnePassEval | None:
        """Every client's prompts through the text tower at once, each segment scored against its own."""
        if type(self).predict is not ClipEvaluator.predict:
            return None
        return OnePassEval(clip_logits, per_client=self.method.prompt_names)


@torch.no_grad()
def clip_logits(model: nn.Module, batch: Batch, owners: Owners) -> Tensor:
    """``ClipEvaluator.predict`` of a concatenated batch, each segment with its own client's prompts."""
    with autocast_for(batch.x):
        return model(image_tokens(batch), owners).float()


class FirstRoundAll(Strategy):
    """FedAvg of the shared prompts; with ``round0_all`` every client trains in round 1 (spec §8.11, the code's
    round 0), then the experiment's participation samples the clients."""

    def select(self, info: RoundInfo, state: Payload) -> list[int]:
        """All clients in round 1 when ``round0_all``, else the sampled ones."""
        if info.round == 1 and self.params.get("round0_all", False):
            return list(range(info.num_clients))
        return super().select(info, state)


class ClipPromptMethod(Method):
    """A method over a frozen PromptedCLIP with learnable contexts ``prompt_names`` of ``n_ctx`` tokens, of which
    ``shared_prompts`` are averaged by the server; batches carry the cached image tokens (artifact clip_tokens)."""

    defaults: ClassVar[dict[str, Any]] = {"n_ctx": 16, "round0_all": False}
    param_rules: ClassVar[dict[str, Any]] = {"n_ctx": Int(1), "round0_all": Flag()}
    prompt_names: ClassVar[tuple[str, ...]] = ("ctx",)
    shared_prompts: ClassVar[tuple[str, ...]] = ("ctx",)
    model_class: ClassVar[type[ContextPrompts]] = ContextPrompts
    client_role = ClipClient
    strategy_role = FirstRoundAll
    evaluator_role = ClipEvaluator

    @classmethod
    def artifacts(cls, params: dict[str, Any]) -> dict[str, str]:
        """The frozen CLIP image tokens of every image."""
        return {TOKENS: "clip_tokens"}

    def check_backbone(self, backbone: nn.Module) -> None:
        """A CLIP prompt adapter and the dataset's class names are needed."""
        if not hasattr(backbone, "encode_text_with_context"):
            raise ValueError(f"method {self.name} needs a CLIP backbone (family clip: PromptedCLIP); got "
                             f"{type(backbone).__name__}")
        if self.class_names is None:
            raise ValueError(f"method {self.name} names the classes in its text prompts: build it with the "
                             "dataset's class_names")

    def build(self, backbone: nn.Module) -> nn.Module:
        """The contexts around the frozen CLIP."""
        self.check_backbone(backbone)
        return self.model_class(backbone, self.class_names, int(self.params["n_ctx"]), self.prompt_names)
