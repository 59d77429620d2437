"""What several prompt methods share: the prompted classifier they train and a recipe that builds it.

The roles (client update, server strategy, evaluator) and the ``Method`` recipe live in the engine
(``fedcore.engine.roles``); a method file subclasses only the pieces where it differs.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from fedcore.backbones.prompted import PromptedViT, init_prompts
from fedcore.constraints import Int
from fedcore.engine.roles import Client, Evaluator, Method, Payload, RoundInfo, Strategy

__all__ = ["PromptClassifier", "PromptMethod", "BatchableClient", "EveryClient", "PersonalEvaluator"]


class PromptClassifier(nn.Module):
    """Frozen prompted ViT + optional shallow/deep prompts + a linear head on the CLS token."""

    def __init__(self, backbone: PromptedViT, num_classes: int, prompt_mode: str = "none",
                 num_prompts: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        dim, depth, patch = backbone.embed_dim, backbone.depth, backbone.patch_size
        self.prompt_mode = prompt_mode
        if prompt_mode == "none":
            self.prompts = nn.ParameterList()
        elif prompt_mode == "shallow":
            self.prompts = nn.ParameterList([init_prompts(num_prompts, dim, patch)])
        elif prompt_mode == "deep":
            self.prompts = nn.ParameterList([init_prompts(num_prompts, dim, patch) for _ in range(depth)])
        else:
            raise ValueError(f"prompt_mode must be none|shallow|deep, got {prompt_mode!r}")
        self.head = nn.Linear(dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """CLS feature after the final norm, with this model's prompts inserted."""
        prompts = {i: p for i, p in enumerate(self.prompts)}
        mode = "replace" if self.prompt_mode == "deep" else "insert"
        return self.backbone.forward_tokens(x, prompts, mode=mode)[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.head(self.features(x))


class PromptMethod(Method):
    """A method whose clients train a ``PromptClassifier`` (prompts of ``prompt_mode`` + a linear head)."""

    #: none | shallow (tokens before block 0) | deep (fresh tokens at every block)
    prompt_mode: ClassVar[str] = "none"

    def build(self, backbone: nn.Module) -> nn.Module:
        """The prompted classifier around ``backbone``."""
        return PromptClassifier(backbone, self.num_classes, self.prompt_mode, int(self.params.get("num_prompts", 0)))


class BatchableClient(Client):
    """The default update (CE epochs, fresh optimiser, nothing random in the loss): clients may train together."""

    batchable = True


class VPTMethod(PromptMethod):
    """FedVPT's recipe (shallow or deep prompts of length ``num_prompts`` + head, FedAvg, clients trained
    together); prompt length 1 by default, SGPT spec 7.15, to match SGPT's prompt budget."""

    defaults = {"num_prompts": 1}
    param_rules = {"num_prompts": Int(1)}
    client_role = BatchableClient


class EveryClient(Strategy):
    """No server: every client trains every round and nothing is aggregated (Local)."""

    def select(self, info: RoundInfo, state: Payload) -> list[int]:
        """All clients, whatever the participation."""
        return list(range(info.num_clients))


class PersonalEvaluator(Evaluator):
    """Each client is scored with its own model: the downlink's tensors, then its personal ones."""

    personalized = True
