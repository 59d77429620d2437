"""A prompt method that can train the entire backbone instead (``representation: prompts | backbone``).

SGPT's Local and FedRep train VPT-shallow prompts on a frozen ViT; FedHPL's and FedPFT's train the whole
extractor (BatchNorm statistics included) from a random draw. One param picks the model, the rest of the
method (who keeps what, how rounds run) is the same for both.
"""
from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from fedcore.constraints import Choice, Constraint, Int
from fedcore.methods.base import INITS, PromptMethod, whole_model

REPRESENTATIONS = ("prompts", "backbone")


class PromptsOrBackbone(PromptMethod):
    """``representation: prompts`` (default): VPT-shallow prompts + head on the frozen backbone, as
    ``PromptMethod``. ``representation: backbone``: the entire backbone + head, trained, from its weights or
    a random draw (``init``), with an optional projection to ``common_dim`` (``base.whole_model``)."""

    prompt_mode = "shallow"
    defaults: ClassVar[dict[str, Any]] = {"num_prompts": 1, "representation": "prompts", "init": "pretrained",
                                          "common_dim": None}
    param_rules: ClassVar[dict[str, Constraint]] = {"num_prompts": Int(1), "representation": Choice(REPRESENTATIONS),
                                                    "init": Choice(INITS), "common_dim": Int(1, optional=True)}

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """``init`` and ``common_dim`` shape a trained backbone: with prompts the backbone is frozen as loaded."""
        if params["representation"] == "prompts" and (params["init"] != "pretrained" or params["common_dim"]):
            raise ValueError("init and common_dim apply to representation: backbone only (with prompts the "
                             f"backbone is frozen as loaded); got init={params['init']!r}, "
                             f"common_dim={params['common_dim']!r}")

    def build(self, backbone: nn.Module) -> nn.Module:
        """The prompted classifier, or the entire-model classifier (``representation: backbone``)."""
        if self.params["representation"] == "backbone":
            return whole_model(backbone, self.num_classes, self.params["init"], self.params["common_dim"])
        return super().build(backbone)
