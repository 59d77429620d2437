"""FedRep: shared representation (VPT-shallow prompts or the whole backbone, FedAvg) + personal heads; head
first, then body."""
from __future__ import annotations

from torch import nn

from fedcore.constraints import Int
from fedcore.engine.optim import ClientData, TrainSettings, only_training, run_epochs
from fedcore.engine.roles import Client, Payload
from fedcore.methods import register_method
from fedcore.methods.base import PersonalEvaluator
from fedcore.methods.representation import PromptsOrBackbone


class FedRepClient(Client):
    """Head phase (representation frozen), then body phase (head frozen); uploads the representation, keeps
    the head."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The representation, everything but the head (the prompts, or the backbone with its BatchNorm
        statistics and projection), is averaged."""
        return [k for k in keys if not k.startswith("head.")]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """Each client's head stays with it."""
        return [k for k in keys if k.startswith("head.")]

    def epochs(self, local_epochs: int) -> tuple[int, int]:
        """(head_epochs, body_epochs) for the experiment's E."""
        body = int(self.params["body_epochs"])
        head = self.params["head_epochs"]
        head = max(local_epochs - body, 1) if head is None else int(head)
        return head, body

    def train_phase(self, model: nn.Module, keys: list[str], data: ClientData, settings: TrainSettings,
                    epochs: int) -> dict[str, float]:
        """Train only ``keys`` for ``epochs`` epochs; every other tensor gets no gradient meanwhile."""
        if epochs <= 0:
            return {"loss": float("nan")}
        with only_training(model, keys) as params:
            return run_epochs(params, data, settings, epochs, lambda b: self.loss(model, b))[0]

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], None]:
        """Head phase, then body phase; loss = epoch-weighted mean of both."""
        head_epochs, body_epochs = self.epochs(settings.local_epochs)
        keys, trainable = self.method.keys(cid), set(self.method.trainable_keys(cid))
        head = self.train_phase(model, self.personal_keys(keys), data, settings, head_epochs)
        body = [k for k in self.shared_keys(keys) if k in trainable]   # BatchNorm statistics are no parameter
        body = self.train_phase(model, body, data, settings, body_epochs)
        parts = [(head["loss"], head_epochs), (body["loss"], body_epochs)]
        parts = [(loss, e) for loss, e in parts if e > 0]
        loss = sum(loss * e for loss, e in parts) / sum(e for _, e in parts) if parts else float("nan")
        return {"loss": loss, "head_loss": head["loss"], "body_loss": body["loss"]}, None


@register_method
class FedRep(PromptsOrBackbone):
    """FedRep (Collins, Hassani, Mokhtari, Shakkottai; ICML 2021): a shared representation and personal heads.

    ``representation: prompts`` (default, SGPT's setting): VPT-shallow prompts on the frozen ViT.
    ``representation: backbone`` (FedHPL's Table 1 setting): the entire backbone, trained, from its weights
    or a random draw (``init``; FedHPL spec §8.15: random), BatchNorm statistics included, with an optional
    projection (``common_dim``), as ``base.WholeModelMethod``.

    Per round, each sampled client (1) trains its personal linear head for ``head_epochs`` epochs with the
    representation frozen, then (2) trains the representation for ``body_epochs`` epochs with the head frozen,
    each phase with a fresh instance of the experiment's optimiser and lr. Only the representation is uploaded
    and averaged by sample count (FedAvg); heads never leave the client and persist across rounds. A client is
    evaluated with the current global representation and its own head (``personalized``).

    Choices where the paper is silent or our setting differs:
    * Epoch split within the experiment's budget E, as in FedRep's code (local_rep_ep = 1, the head gets
      the other local_ep - 1 epochs): body_epochs = 1, head_epochs = E - 1 (at least 1, so E = 1 costs 2).
    * The representation is the frozen ViT's VPT-shallow prompts (length 1 at block 0, SGPT spec 7.15),
      not a trained CNN body; the head is the linear classifier on the final-norm CLS token.
    * The frozen part of each phase gets no gradient at all (requires_grad off), so the head phase runs
      the backbone forward only; the optimiser is the experiment's (FedRep's code: SGD, momentum 0.5, weight decay
      1e-4 on all but biases; ours decays every trained tensor).
    * The representation is averaged by sample count; FedRep's code weighs its CIFAR/MNIST clients equally
      (``lens = np.ones``, equal shards there) and its LEAF clients by sample count.
    * No final round: FedRep's code ends with one more round in which every client fine-tunes its head alone
      for max(10, E - 1) epochs before the last evaluation (``main_fedrep.py``: ``last``); equal to ours with
      ``head_epochs: 10, body_epochs: 0`` run once more (checked, tests/test_official_fedrep.py).
    * A client never sampled keeps its initial head (its own, as the paper's personal heads), so it scores
      about chance. FedRep's code differs: a client not yet trained holds references to the global model's
      tensors (``w_locals``, main_fedrep.py:111-115), which the server's average of every key, heads included,
      overwrites in place, so it holds the mean of the last round's trained heads. Every
      client is evaluated each evaluated round (SGPT spec 3.5), sampled or not.
    * ``representation: backbone``: FedHPL (B.3) trains the head for 10 epochs ("the last local epoch of
      FedRep we train 10 local epochs"): set ``head_epochs: 10, body_epochs: 1``. In the head phase the
      frozen backbone stays in train mode (its BatchNorm statistics keep updating, as in PFLlib's FedRep).
      ``num_prompts`` is unused there.
    """

    name = "fedrep"
    defaults = {**PromptsOrBackbone.defaults, "body_epochs": 1, "head_epochs": None}
    param_rules = {**PromptsOrBackbone.param_rules, "body_epochs": Int(0), "head_epochs": Int(0, optional=True)}
    client_role = FedRepClient
    evaluator_role = PersonalEvaluator
