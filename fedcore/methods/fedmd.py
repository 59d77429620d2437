"""FedMD: heterogeneous FL by model distillation on a public dataset (Li & Wang, NeurIPS 2019 workshop,
arXiv:1910.03581), as FedHPL (spec fedhpl §5, §8.16, Table 2) runs it: entire heterogeneous ResNets."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Constraint, Int, RunFacts, Violation
from fedcore.data.facts import FACTS, dataset_facts
from fedcore.engine.data import Batch, iterate_batches
from fedcore.engine.loop import trains_batchnorm
from fedcore.engine.optim import ClientData, TrainSettings, run_epochs
from fedcore.engine.roles import (Client, ExtraData, FitResult, Payload, RoundInfo, Strategy,
                                  module_state)
from fedcore.engine.sampling import sample_clients, stream_seed
from fedcore.methods import register_method
from fedcore.methods.base import PersonalEvaluator, WholeModelMethod

PUBLIC = "public"                 # the role of the extra dataset (Method.extra_datasets)
TRANSFERRED = "transferred"       # client state: the transfer-learning phase (public pretraining) is done
SUBSET_STREAM = 0xFED0            # seed stream of the public subset drawn each round


@dataclass(frozen=True)
class PublicDataset(Constraint):
    """A known dataset other than the run's own (FedMD's public classes are disjoint from the private ones)."""

    def violation(self, key: str, value: Any, facts: RunFacts | None) -> Violation | None:
        """See Constraint."""
        if value not in FACTS:
            return Violation(key, value, f"one of {sorted(FACTS)}")
        if facts is not None and value == facts.dataset:
            return Violation(key, value, f"a dataset other than the run's own ({facts.dataset})")
        return None


def digest_loss(logits: Tensor, consensus: Tensor) -> Tensor:
    """FedMD's digest: the mean absolute difference between the model's logits and the consensus logits."""
    return (logits - consensus).abs().mean()


def consensus_of(logits: list[Tensor]) -> Tensor:
    """The server's consensus: the plain mean of the clients' logits on the same public samples."""
    return torch.stack([x.double() for x in logits]).mean(dim=0).float()


class FedMDClient(Client):
    """Transfer learning once (public CE), then each round digest (fit the consensus) and revisit (private CE);
    uploads its logits on the round's public subset, never a tensor of its model."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """Nothing of the model is sent."""
        return []

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The whole model (BatchNorm statistics included) stays with the client."""
        return list(keys)

    def fit(self, cid: int, state: Payload, downlink: Payload, data: ClientData,
            settings: TrainSettings) -> tuple[Payload, FitResult]:
        """[transfer learning on a client's first fit] -> digest -> revisit -> logits on the round's public subset."""
        model = self.method.model_for(cid)
        self.start(model, cid, state, downlink)
        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        stats: dict[str, float] = {}
        if not state.get(TRANSFERRED, False):
            stats["pretrain_loss"] = self.pretrain(model, params, data, settings)
        if len(downlink["consensus_index"]):
            stats["digest_loss"] = self.digest(model, params, downlink, data, settings)
        stats["loss"] = self.revisit(model, params, data, settings)
        new_state = {**state, "model": module_state(model, self.personal_keys(self.method.keys(cid))),
                     TRANSFERRED: True}
        uplink = self.public_logits(model, downlink["upload_index"], settings)
        return new_state, FitResult(cid, data.num_samples, uplink, stats)

    def _public(self) -> ExtraData:
        return self.method.public_data

    def _public_batches(self, model: nn.Module, idx: Tensor, data: ClientData, settings: TrainSettings) -> ClientData:
        """Shuffled batches of the public rows ``idx``, drawn from the client's round generator; a last batch of
        one sample is skipped when ``model`` trains BatchNorm (torch cannot normalise it; the engine's rule for
        the private data)."""
        pub = self._public()
        idx = idx.to(pub.split.y.device)
        least = 2 if trains_batchnorm(model) else 1
        return ClientData(data.cid, len(idx), lambda: iterate_batches(pub.split, idx, settings.batch_size,
                                                                      pub.pipeline, data.generator, min_batch=least),
                          data.generator)

    def pretrain(self, model: nn.Module, params: list[nn.Parameter], data: ClientData,
                 settings: TrainSettings) -> float:
        """Transfer learning: ``pretrain_epochs`` of CE on every public sample, labels after the n_c private ones."""
        pub, offset = self._public(), self.method.num_classes
        batches = self._public_batches(model, torch.arange(len(pub.split.y)), data, settings)
        loss = lambda b: F.cross_entropy(model(b.x).float(), b.y + offset)  # noqa: E731
        return run_epochs(params, batches, settings, int(self.params["pretrain_epochs"]), loss)[0]["loss"]

    def digest(self, model: nn.Module, params: list[nn.Parameter], downlink: Payload, data: ClientData,
               settings: TrainSettings) -> float:
        """``digest_epochs`` of fitting the consensus logits on the public samples they were computed on."""
        pub = self._public()
        idx = downlink["consensus_index"].to(pub.split.y.device)
        target = torch.zeros(len(pub.split.y), self.method.head_classes, device=idx.device)
        target[idx] = downlink["consensus"].to(idx.device)

        def loss(b: Batch) -> Tensor:
            return digest_loss(model(b.x).float(), target[b.index])
        return run_epochs(params, self._public_batches(model, idx, data, settings), settings,
                          int(self.params["digest_epochs"]), loss)[0]["loss"]

    def revisit(self, model: nn.Module, params: list[nn.Parameter], data: ClientData,
                settings: TrainSettings) -> float:
        """``revisit_epochs`` (default: the experiment's local epochs) of CE on the private data."""
        epochs = self.params["revisit_epochs"]
        epochs = settings.local_epochs if epochs is None else int(epochs)
        return run_epochs(params, data, settings, epochs, lambda b: self.loss(model, b))[0]["loss"]

    @torch.no_grad()
    def public_logits(self, model: nn.Module, idx: Tensor, settings: TrainSettings) -> Payload:
        """The uplink: logits (all n_c + n_p outputs) on the public rows ``idx``, eval mode, in order, with ``idx``."""
        pub = self._public()
        was_training = model.training
        model.eval()
        try:
            out = [self.method.evaluator.predict(model, b)
                   for b in iterate_batches(pub.split, idx.to(pub.split.y.device), settings.batch_size, pub.pipeline)]
        finally:
            model.train(was_training)
        return {"logits": torch.cat(out).float(), "index": idx.long()}


class FedMDServer(Strategy):
    """Draws the round's public subset, averages the clients' logits on it into the consensus."""

    def init_state(self, num_clients: int) -> Payload:
        """No consensus yet (round 1 has no digest)."""
        none = torch.zeros(0, dtype=torch.long)
        return {"consensus": torch.zeros(0, self.method.head_classes), "consensus_index": none, "upload_index": none}

    def subset(self, info: RoundInfo) -> Tensor:
        """The public rows whose logits the round's clients upload: all, or ``public_subset`` of them drawn
        from (seed, round), sorted."""
        n, size = len(self.method.public_data.split.y), self.params["public_subset"]
        if size is None:
            return torch.arange(n)
        gen = torch.Generator().manual_seed(stream_seed(info.seed, info.round, 0, SUBSET_STREAM))
        return torch.randperm(n, generator=gen)[:int(size)].sort().values

    def select(self, info: RoundInfo, state: Payload) -> list[int]:
        """The round's clients; also fixes the round's public subset in the server state (seeded, so a resumed
        run draws the same)."""
        state["upload_index"] = self.subset(info)
        return sample_clients(info.num_clients, info.participation, info.seed, info.round)

    def configure(self, state: Payload, cid: int) -> Payload:
        """The consensus of the previous round (what to digest) and the public rows to upload logits on."""
        return {"consensus": state["consensus"], "consensus_index": state["consensus_index"],
                "upload_index": state["upload_index"]}

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """The consensus: the mean of the round's uploaded logits, all on the round's public subset."""
        if not results:
            return state
        index = state["upload_index"]
        for r in results:
            if not torch.equal(r.uplink["index"].cpu(), index.cpu()):
                raise RuntimeError(f"fedmd: client {r.cid} uploaded logits on other public rows than the round's")
        return {**state, "consensus": consensus_of([r.uplink["logits"].cpu() for r in results]),
                "consensus_index": index.clone()}


@register_method
class FedMD(WholeModelMethod):
    """FedMD (Li & Wang, "FedMD: Heterogenous Federated Learning via Model Distillation", 2019).

    Trained: each client's entire model (its own architecture, ``init: random`` for Table 2) with n_c + n_p
    outputs, the public dataset's n_p = ``public_classes`` classes after the n_c private ones. A client's first
    fit starts with transfer learning: ``pretrain_epochs`` (paper: 50) epochs of CE on the whole public train
    split. Every round then: digest (``digest_epochs`` of fitting the previous round's consensus logits on its
    public samples, mean absolute error on the logits as in FedMD's code), revisit (``revisit_epochs``, default
    the experiment's local epochs, paper 5, of CE on the private data), and upload the logits on the round's
    public subset. Uploaded: (n_c + n_p + 1)·|D_p| numbers, logits plus row ids (Table 9: 21·|D_p| /
    111·|D_p|); no model tensor leaves a client. Aggregated: the consensus, the plain mean of the uploaded
    logits. Evaluated: each client's own model (``PersonalEvaluator``), argmax over all its outputs (a
    public-class prediction is an error), as FedMD's code scores its models.

    The engine's round r = FedMD's "communicate" of round r + 1 moved to its end: digest(consensus of r - 1) ->
    revisit -> upload on the subset of r; so round 1 = transfer learning + revisit + the first upload, exactly
    FedMD's order (train on public, then private, then collaborate).

    Choices where the paper and spec are silent (DEVIATIONS.md, FedMD):
    * The public dataset (spec §8.16): ``public`` names a dataset bundle the pipeline builds (paper scale:
      CIFAR-10 for CIFAR-100 and SVHN, SVHN for CIFAR-10; mini: ``digits_public``, the held-out digits rendered
      inverted); its train split is the public data. ``public_subset`` rows (None: all) are drawn each round
      from (seed, round), FedMD's N_alignment (5000 in its CIFAR runs).
    * Every phase uses the experiment's optimiser, fresh (FedMD's code used Adam 1e-3 for the digest), and the
      experiment's batch size (FedMD's CIFAR code: 128 for transfer learning, 256 for the digest, 5 for the
      revisit). The transfer learning runs a fixed number of epochs, not to convergence (FedMD: early stopping).
    * FedMD's code then trains each model on its private data (up to 25 epochs, early stopping on the private
      test set) before the first communication; here round 1's revisit (``revisit_epochs``) is the only private
      training before the first upload.
    * The n_p public classes come after the n_c private ones (FedMD's code puts them first): labels only.
    * Logits for the upload: eval mode (BatchNorm statistics), no augmentation; the digest reads the consensus
      in float32 (the server averages in float64).
    """

    name = "fedmd"
    defaults: dict[str, Any] = {**WholeModelMethod.defaults, "public": None, "public_classes": 10,
                                "public_subset": None, "pretrain_epochs": 50, "digest_epochs": 1,
                                "revisit_epochs": None}
    param_rules = {**WholeModelMethod.param_rules, "public": PublicDataset(), "public_classes": Int(1),
                   "public_subset": Int(1, optional=True), "pretrain_epochs": Int(0), "digest_epochs": Int(0),
                   "revisit_epochs": Int(0, optional=True)}
    client_role = FedMDClient
    strategy_role = FedMDServer
    evaluator_role = PersonalEvaluator

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """The public dataset must have ``public_classes`` classes and at least ``public_subset`` train images."""
        facts = dataset_facts(params["public"])
        if facts.classes != params["public_classes"]:
            raise ValueError(f"method_params.fedmd: key 'public_classes' = {params['public_classes']}: the public "
                             f"dataset {params['public']} has {facts.classes} classes")
        size = params["public_subset"]
        if size is not None and facts.train.size is not None and size > facts.train.size:
            raise ValueError(f"method_params.fedmd: key 'public_subset' = {size}: the public dataset "
                             f"{params['public']} has only {facts.train.size} train images")

    @classmethod
    def extra_datasets(cls, params: dict[str, Any]) -> dict[str, str]:
        """The public dataset."""
        return {PUBLIC: params["public"]}

    def attach_dataset(self, role: str, data: ExtraData) -> None:
        """Keep the public data after checking it has the declared classes and enough images."""
        p = self.params
        if role != PUBLIC:
            raise ValueError(f"fedmd reads only a '{PUBLIC}' dataset, got {role!r}")
        y = data.split.y
        if data.num_classes != p["public_classes"] or (len(y) and int(y.max()) >= p["public_classes"]):
            raise ValueError(f"method_params.fedmd: key 'public_classes' = {p['public_classes']}, but the public "
                             f"dataset {p['public']} has {data.num_classes} classes (labels up to {int(y.max())})")
        if p["public_subset"] is not None and p["public_subset"] > len(y):
            raise ValueError(f"method_params.fedmd: key 'public_subset' = {p['public_subset']}, but the public "
                             f"dataset {p['public']} has {len(y)} train images")
        super().attach_dataset(role, data)

    @property
    def public_data(self) -> ExtraData:
        """The attached public dataset."""
        if PUBLIC not in self.extra_data:
            raise RuntimeError(f"fedmd: no public dataset was attached (train_run's extra_datasets['{PUBLIC}'])")
        return self.extra_data[PUBLIC]

    @property
    def head_classes(self) -> int:
        """n_c private + n_p public outputs."""
        return self.num_classes + int(self.params["public_classes"])


__all__ = ["FedMD", "consensus_of", "digest_loss"]
