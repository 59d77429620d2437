"""Zero-shot CLIP: no training, hand-written prompts."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.methods import register_method
from fedcore.methods.clip_prompt import ClipClient, ClipEvaluator, ClipPromptMethod, cls_logits, fp32

TEMPLATE = "a photo of a {}."  # the code's trainers/clip.py


class ZeroShotPrompts(nn.Module):
    """Frozen CLIP + the fixed normalised text features of "a photo of a {class}." (a buffer: nothing trains)."""

    def __init__(self, clip: nn.Module, class_names: list[str]) -> None:
        super().__init__()
        self.clip = clip
        with torch.no_grad():
            text = clip.encode_text([TEMPLATE.format(c.replace("_", " ")) for c in class_names])
        self.register_buffer("text", F.normalize(text.float(), dim=-1), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits (B, K): CLIP's logit scale x cos(CLS token, class text feature)."""
        with fp32(tokens):
            return cls_logits(tokens, self.text, self.clip.logit_scale)


class ZeroShotClient(ClipClient):
    """Nothing to train, keep or send."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """Nothing is sent."""
        return []

    def personal_keys(self, keys: list[str]) -> list[str]:
        """Nothing is kept."""
        return []


@register_method
class ZeroShotCLIP(ClipPromptMethod):
    """Zero-shot CLIP (Radford et al., 2021; spec fedotp §4.1): each class's text feature of "a photo of a {class}."
    ([C] trainers/clip.py; "_" read as a space), logits = CLIP's logit scale x cos(CLS token, text feature); no
    parameter trains, so a round costs no pass over the data (engine: a model with nothing trainable) and the
    experiment's rounds only set when it is scored (one round suffices). Every client is scored on its own test
    split, with class names in label order ([R] spec §8.2: the code's set order pairs prompts with wrong names);
    the code scores a random fraction of the clients once."""

    name = "zs_clip"
    defaults: dict[str, Any] = {}
    param_rules: dict[str, Any] = {}
    prompt_names = ()
    shared_prompts = ()
    client_role = ZeroShotClient
    evaluator_role = ClipEvaluator

    def build(self, backbone: nn.Module) -> nn.Module:
        """The fixed zero-shot text features around the frozen CLIP."""
        self.check_backbone(backbone)
        return ZeroShotPrompts(backbone, self.class_names)
