"""FedVPT: VPT-shallow prompts at the first block's input plus a linear head, averaged by FedAvg."""
from __future__ import annotations

from torch import nn

from fedcore.methods.base import Method, PromptClassifier


class FedVPT(Method):
    """Shallow visual prompts + head; SGPT spec 7.15 recommends prompt length 1 to match SGPT's budget."""

    name = "fedvpt"
    batched_clients = True
    defaults = {"num_prompts": 1}

    def build(self) -> nn.Module:
        """Prompted classifier with ``num_prompts`` tokens inserted once, before block 0."""
        return PromptClassifier(self.backbone, self.num_classes, "shallow", self.params["num_prompts"])
