"""FedVPT-D: VPT-deep prompts (new tokens at every block, replacing the previous block's) + head, FedAvg."""
from __future__ import annotations

from torch import nn

from fedcore.methods.base import Method, PromptClassifier


class FedVPTDeep(Method):
    """Deep visual prompts + head; prompt length 1 per block by default (SGPT spec 7.15)."""

    name = "fedvpt_d"
    batched_clients = True
    defaults = {"num_prompts": 1}

    def build(self) -> nn.Module:
        """Prompted classifier with ``num_prompts`` tokens per block, replaced at every block."""
        return PromptClassifier(self.backbone, self.num_classes, "deep", self.params["num_prompts"])
