"""FedBABU (Oh, Kim, Yun; ICLR 2022): body trained and averaged, head random and frozen; fine-tuned at evaluation."""
from __future__ import annotations

import torch
from torch import nn

from fedcore.constraints import Int
from fedcore.engine.optim import ClientData, TrainSettings, only_training, run_epochs
from fedcore.engine.roles import Client, Evaluator, Payload, load_state
from fedcore.methods import register_method
from fedcore.methods.base import WholeModelMethod


def is_head(key: str) -> bool:
    """Whether a state key belongs to the linear head."""
    return key.startswith("head.")


class FedBABUClient(Client):
    """Trains and uploads the body; the head is the model's initial one, reloaded every round, never trained."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The body (backbone, its BatchNorm statistics, the projection if any)."""
        return [k for k in keys if not is_head(k)]

    def start(self, model: nn.Module, cid: int, state: Payload, downlink: Payload) -> None:
        """The downlink's body, then the fixed initial head (evaluation may have fine-tuned the module's)."""
        super().start(model, cid, state, downlink)
        load_state(model, self.method.initial_state(cid, [k for k in self.method.keys(cid) if is_head(k)]))

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], None]:
        """E epochs of CE over the body; the head gets no gradient."""
        body = [k for k in self.method.trainable_keys(cid) if not is_head(k)]
        with only_training(model, body) as params:
            return run_epochs(params, data, settings, settings.local_epochs, lambda b: self.loss(model, b))[0], None


class FineTunedEvaluator(Evaluator):
    """Each client fine-tunes the entire model (global body + fixed head) on its own train data, then is scored."""

    personalized = True

    def load(self, model: nn.Module, cid: int | None, server: Payload, client_state: Payload | None,
             data: ClientData | None) -> None:
        """The global body and the fixed head; for a client, then ``finetune_epochs`` epochs of CE over every
        trainable tensor with a fresh instance of the experiment's optimiser (BatchNorm in train mode)."""
        super().load(model, cid, server, client_state, data)
        if cid is None:
            self.method.client.start(model, 0, {}, {})
            return
        if data is None or data.settings is None:
            raise ValueError(f"{self.method.name}: fine-tuning client {cid} needs its train data and the experiment's "
                             "settings (ClientData.settings)")
        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        mode = model.training
        model.train()
        try:
            with torch.enable_grad():
                run_epochs(params, data, data.settings, int(self.params["finetune_epochs"]),
                           lambda b: self.method.client.loss(model, b))
        finally:
            model.train(mode)


@register_method
class FedBABU(WholeModelMethod):
    """FedBABU (Oh, Kim, Yun; ICLR 2022) on the entire model.

    The head (a linear layer) is randomly initialised once and never trained during federation: it is the
    same on every client, never sent, and reloaded from the initial model every round. Each client trains the
    body (backbone with its BatchNorm statistics; ``init`` pretrained or a random draw, FedHPL spec §8.15:
    random) for E epochs of CE and uploads it; the server averages it by sample count (FedAvg). Evaluation is
    personalised: every evaluated round, each client takes the current global body and the fixed head,
    fine-tunes the ENTIRE model for ``finetune_epochs`` = 10 epochs on its own train data (FedHPL B.3/C.1.1:
    "we prefer the entire model") and is scored with it; the fine-tuned model is discarded afterwards.

    Choices where the papers are silent:
    * Fine-tuning uses a fresh instance of the experiment's optimiser and lr (PFLlib reuses the client's
      optimiser), the experiment's batch size, batches in a seeded order of their own (engine stream 2), and
      BatchNorm in train mode; it is deterministic.
    * It runs at every evaluated round from the global body, not once after the last round (PFLlib), so the
      curve and the final number use the same protocol. Cost: ``finetune_epochs`` local epochs per client per
      evaluated round; ``finetune_epochs: 0`` scores the body with the fixed head.
    * The head is the linear layer with a bias that every entire-model method here uses: weight and bias are
      frozen during federation and both fine-tuned at evaluation.

    Where the authors' code (jhoon-oh/FedBABU ``main_fed.py``, ``analysis.ipynb``) differs, ours is kept (checked
    in tests/test_official_fedbabu.py): its server averages the bodies with equal weights (ours by sample count,
    as FedAvg; equal for their equal-size shards); its script decays the lr x0.1 at rounds R/2 and 3R/4 (ours: the
    experiment's lr, constant); its clients upload the untouched head too, dropped at the broadcast; and its
    personalisation fine-tunes once, the round with the best test accuracy, with its own recipe (5 epochs, lr
    1e-3 where training used 0.1, momentum, no weight decay), where ours uses the experiment's optimiser.
    """

    name = "fedbabu"
    defaults = {**WholeModelMethod.defaults, "finetune_epochs": 10}
    param_rules = {**WholeModelMethod.param_rules, "finetune_epochs": Int(0)}
    client_role = FedBABUClient
    evaluator_role = FineTunedEvaluator
