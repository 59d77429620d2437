"""Head-Tune: only the linear classifier on the frozen CLS feature, averaged by FedAvg (SGPT Table 1)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.engine.batching import OnePass, epochs_of_loss
from fedcore.engine.data import Batch
from fedcore.engine.onepass import Owners
from fedcore.engine.optim import autocast_for
from fedcore.engine.roles import Client, Evaluator, Together
from fedcore.methods import register_method
from fedcore.methods.base import PromptMethod


class HeadClient(Client):
    """Cross-entropy of the head on cached features (batches carry features as ``x``)."""

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """CE of the head alone."""
        return F.cross_entropy(model.head(batch.x), batch.y)

    def client_losses(self, model: nn.Module, batch: Batch, owners: Owners) -> Tensor:
        """Each client's ``loss`` with its own head on its segment of a concatenated batch (one pass)."""
        return owners.per_client(F.cross_entropy, owners.linear(batch.x, model.head.weight, model.head.bias), batch.y)

    def together(self, device: str, model: nn.Module) -> Together:
        """The round's heads in one pass over the concatenated features."""
        return epochs_of_loss(self, device, model, one_pass=OnePass(self.client_losses), vmap=False)


class HeadEvaluator(Evaluator):
    """Logits of the head on cached features."""

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> Tensor:
        """The head's logits."""
        return model.head(batch.x)


@register_method
class HeadTune(PromptMethod):
    """Linear probe trained federatedly.

    The CLS feature does not depend on anything trained, so the engine computes it once per image and
    the local updates and evaluations only run the head (same numbers, far less compute).
    """

    name = "head_tune"
    client_role = HeadClient
    evaluator_role = HeadEvaluator

    def frozen_features(self) -> Callable[[Tensor], Tensor]:
        """The un-prompted backbone's final-norm CLS token (bf16 on CUDA, like every other forward)."""
        model = self.model

        def cls(x: Tensor) -> Tensor:
            with autocast_for(x):
                return model.features(x)
        return cls
