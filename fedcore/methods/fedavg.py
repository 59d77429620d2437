"""FedAvg with full fine-tuning: the whole ViT and the head are trained and averaged (McMahan et al.)."""
from __future__ import annotations

from torch import nn

from fedcore.methods.base import PromptMethod


class FedAvg(PromptMethod):
    """Full-model FedAvg: unfreezes the backbone of this run's (private) model copy; every role is the default."""

    name = "fedavg"

    def build(self, backbone: nn.Module) -> nn.Module:
        """Head-on-CLS classifier whose backbone parameters are all trainable."""
        model = super().build(backbone)
        for p in model.backbone.parameters():
            p.requires_grad_(True)
        return model
