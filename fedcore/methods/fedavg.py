"""FedAvg with full fine-tuning: the whole ViT and the head are trained and averaged (McMahan et al.)."""
from __future__ import annotations

from torch import nn

from fedcore.methods.base import Method, PromptClassifier


class FedAvg(Method):
    """Full-model FedAvg: unfreezes the backbone of this run's (private) model copy."""

    name = "fedavg"

    def build(self) -> nn.Module:
        """Head-on-CLS classifier whose backbone parameters are all trainable."""
        model = PromptClassifier(self.backbone, self.num_classes)
        for p in model.backbone.parameters():
            p.requires_grad_(True)
        return model
