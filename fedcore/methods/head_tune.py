"""Head-Tune: only the linear classifier on the frozen CLS feature, averaged by FedAvg (SGPT Table 1)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fedcore.methods.base import Method, autocast_for


class HeadTune(Method):
    """Linear probe trained federatedly.

    The CLS feature does not depend on anything trained, so the engine computes it once per image and
    the local updates and evaluations only run the head (same numbers, far less compute).
    """

    name = "head_tune"

    def frozen_features(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The un-prompted backbone's final-norm CLS token (bf16 on CUDA, like every other forward)."""
        def cls(x: torch.Tensor) -> torch.Tensor:
            with autocast_for(x):
                return self.model.features(x)
        return cls

    def loss(self, feats: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the head on cached features."""
        return nn.functional.cross_entropy(self.model.head(feats), y)

    @torch.no_grad()
    def predict(self, feats: torch.Tensor) -> torch.Tensor:
        """Logits of the head on cached features."""
        return self.model.head(feats)
