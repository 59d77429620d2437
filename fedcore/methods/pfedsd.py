"""pFedSD (Jin et al., 2022): the entire model, FedAvg; each client distils from its own previous personalised model."""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Number
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings, run_epochs
from fedcore.engine.roles import Client, Evaluator, Payload, load_state
from fedcore.methods import register_method
from fedcore.methods.base import WholeModelMethod


def self_distillation_loss(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """T² · KL(softmax(teacher/T) ‖ softmax(student/T)), mean over the batch (pFedSD's ``_divergence``)."""
    log_student = F.log_softmax(student / temperature, dim=1)
    target = F.softmax(teacher / temperature, dim=1)
    return F.kl_div(log_student, target, reduction="batchmean") * temperature ** 2


class PFedSDClient(Client):
    """Starts from the global model, trains CE + λ·KD from its previous personalised model (its state), keeps
    the trained model as its new personalised model and uploads it whole."""

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The whole trained model is the client's personalised model (and next round's teacher)."""
        return list(keys)

    def init_state(self, cid: int) -> Payload:
        """No personalised model before the first participation (pFedSD: no distillation then)."""
        return {"model": {}}

    def start(self, model: nn.Module, cid: int, state: Payload, downlink: Payload) -> None:
        """The global model only: the personalised model is the teacher, not the starting point."""
        load_state(model, downlink.get("model", {}))

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], None]:
        """E epochs of CE (+ λ·T²·KL to the teacher's logits once the client has a personalised model)."""
        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        personal = state.get("model") or {}
        teacher = None
        if personal:
            teacher = self.method.teacher_for(cid)
            load_state(teacher, personal)
            teacher.train()  # as the official worker: the teacher is a copy of the model in train mode
        lam, temp = float(self.params["lam"]), float(self.params["temperature"])

        def loss(b: Batch) -> Tensor:
            logits = model(b.x).float()
            ce = F.cross_entropy(logits, b.y)
            if teacher is None:
                return ce
            with torch.no_grad():
                target = teacher(b.x).float()
            return ce + lam * self_distillation_loss(logits, target, temp)

        return run_epochs(params, data, settings, settings.local_epochs, loss)[0], None


class PersonalisedModelEvaluator(Evaluator):
    """Client k is scored with its personalised model (the one it trained last); the global model until then."""

    personalized = True

    def load(self, model: nn.Module, cid: int | None, server: Payload, client_state: Payload | None,
             data: ClientData | None) -> None:
        """The global model, overwritten by the client's personalised model when it has one."""
        load_state(model, server.get("model", {}))
        if cid is not None:
            load_state(model, (client_state or {}).get("model") or {})


@register_method
class PFedSD(WholeModelMethod):
    """pFedSD (Jin, Chen, Chen, Zhu, Li, Wei, Cui, Zhang; "Personalized Edge Intelligence via Federated
    Self-Knowledge Distillation", IEEE TPDS 2022/23; code CGCL-codes/pFedSD) on the entire model.

    Each round a client loads the global model (extractor with its BatchNorm statistics + linear head), trains
    it for E epochs with CE + ``lam`` · T² · KL(softmax(v/T) ‖ softmax(w/T)) (batch mean), where v are the
    logits of its own personalised model of its previous participation (the teacher, no gradient) and
    T = ``temperature``; at its first participation it trains with CE only. The trained model becomes its new
    personalised model (kept in its state) and is uploaded whole; the server averages by sample count (FedAvg).
    Evaluation: each client's personalised model (the official "before aggregation" test; a client that never
    trained: the global model).

    Hyperparameters: λ = 0.5, T = 3: the authors' group framework FLAIR-Community/Fling
    (``flzoo/*/*_pfedsd_resnet_config.py``: ``lamda=0.5, tau=3``), FedPFT spec's External references. Choices
    where the papers are silent: the teacher runs in train mode (BatchNorm normalises by batch statistics), as
    in the official worker and Fling (a copy of the model in train mode); its own statistics updates are
    discarded. The optimiser is the experiment's, fresh each round.

    Where the original code (CGCL-codes/pFedSD, tests/test_official_pfedsd.py) differs, ours follows Fling and
    FedAvg: its server averages the parameters only, 1/|S_t| (master_pFedSD.py:187-195; BatchNorm statistics sent
    stay the initial ones), ours every state key by sample count; it scores a client not yet trained with the
    initial model (round 1), ours with the global model; its defaults are λ = 1, T = 1 (parameters.py:249, 251).
    """

    name = "pfedsd"
    defaults = {**WholeModelMethod.defaults, "lam": 0.5, "temperature": 3.0}
    param_rules = {**WholeModelMethod.param_rules, "lam": Number(0.0), "temperature": Number(0.0, lo_open=True)}
    client_role = PFedSDClient
    evaluator_role = PersonalisedModelEvaluator

    def teacher_for(self, cid: int) -> nn.Module:
        """A second module of client ``cid``'s architecture that holds its teacher (built on first use)."""
        if not hasattr(self, "_teachers"):
            self._teachers: dict[int, nn.Module] = {}
        i = self.backbone_index(cid)
        if i not in self._teachers:
            self._teachers[i] = copy.deepcopy(self.models[i]).requires_grad_(False)
        return self._teachers[i]
