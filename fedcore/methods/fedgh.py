"""FedGH: federated global prediction header (Yi, Wang, Liu, Yu, Yu, Li; ACM MM 2023), as HtFLlib runs it (FedHPL
Table 2, spec fedhpl §5).

Model. Every client trains its entire model (``WholeModelMethod``: its own ResNet, random init at paper scale,
``common_dim`` so that every representation has one width: FedGH's "linear layer to align representations")
behind one global linear head H_g (``GlobalHeadMethod``).

Client update. The client's head is replaced by H_g, then the whole model (extractor and that head) trains with CE
for the local epochs with the experiment's optimiser (FedHPL §2: SGD, momentum 0.9, weight decay), fresh each round
(HtFLlib: a fresh plain SGD at the same lr); the locally trained head is discarded.

Upload. After training, one pass over the client's train set (eval mode, no augmentation, no gradient): per class
present the mean representation (the head's input) and the class label: C·d + C = 5130 at d = 512, C = 10
(51300 at C = 100), Table 9. Nothing of the extractor leaves the client.

Server. H_g (client 0's initial head at start, HtFLlib) trains on the round's uploaded (mean representation,
label) pairs: ``server_epochs`` epochs of SGD (lr ``server_lr``, no momentum, a fresh optimiser each round) with CE
over shuffled mini-batches of ``server_batch_size`` pairs (HtFLlib: server lr 0.01, 1 server epoch). H_g is the
server state (checkpointed every round) and the downlink; clients replace their head with it.

Evaluation (spec §3.3): each client's own extractor with H_g (personalised), on the full test set.

Choices where the paper (and FedHPL) is silent, recorded in DEVIATIONS.md (FedHPL baselines, FedGH):
* The head trains locally along with the extractor and is then dropped (HtFLlib); every pair counts equally
  at the server, whatever the client's size (HtFLlib).
* ``server_batch_size`` 16 (HtFLlib: the local batch size; spec §2: bs 16); the server's shuffle is seeded by
  (run seed, round).
* Representations are taken in eval mode (BatchNorm statistics, HtFLlib's ``collect_protos``), averaged in
  float64 and sent in float32.
* The alignment layer is our ``common_dim`` Linear (identity on ResNet18/34 at 512, 2048 -> 512 on ResNet50);
  HtFLlib uses a parameter-free ``AdaptiveAvgPool1d`` there. Table 7's FedGH rows match neither.

The authors' code (LipingYi/FedGH ``FedGH_mh.py``, tests/test_official_fedgh.py) differs, and ours keeps the paper's
steps (Fig. 1) and HtFLlib's: its server steps the clients' optimiser, never the header's, so its global header
stays the random init (FedGH_mh.py:269-271), ours trains H_g; it uploads per class the mean of per-batch class means
(ours: over all samples); its first round trains each client behind its own initial head (ours: H_g); it scores the
locally trained head before the server step (ours: H_g); it clips gradient norms at 50 (ours: no clip). Ours follows
it, not HtFLlib, on the client optimiser (momentum and weight decay) and shuffled loaders that keep the last batch.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Int, Number
from fedcore.engine.optim import ClientData, autocast_for
from fedcore.engine.roles import FitResult, Payload, RoundInfo, Strategy
from fedcore.engine.sampling import stream_seed
from fedcore.methods import register_method
from fedcore.methods.base import per_class_sums
from fedcore.methods.global_head import GlobalHeadClient, GlobalHeadMethod

SERVER_STREAM = 102  # stream_seed stream of the server's shuffle (clients use 0..3)


# ---- the rules ------------------------------------------------------------------------------------------
def class_means(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """(means (P, d), classes (P,)): the mean feature of each class present, classes ascending."""
    sums, counts = per_class_sums(features, labels, num_classes)
    present = torch.nonzero(counts).flatten()
    return (sums[present] / counts[present, None]).float(), present


def train_head(head: dict[str, Tensor], reps: Tensor, labels: Tensor, lr: float, epochs: int, batch_size: int,
               generator: torch.Generator) -> dict[str, Tensor]:
    """H_g after ``epochs`` epochs of plain SGD with CE on (representation, label) pairs in shuffled mini-batches."""
    weight = head["head.weight"].detach().clone().float().requires_grad_(True)
    bias = head["head.bias"].detach().clone().float().requires_grad_(True)
    opt = torch.optim.SGD([weight, bias], lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator).to(labels.device)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            loss = F.cross_entropy(F.linear(reps[idx], weight, bias), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return {"head.weight": weight.detach().to(head["head.weight"].dtype),
            "head.bias": bias.detach().to(head["head.bias"].dtype)}


# ---- roles ------------------------------------------------------------------------------------------------
class FedGHClient(GlobalHeadClient):
    """Whole model with CE behind H_g; uploads per-class mean representations and their labels."""

    @torch.no_grad()
    def representations(self, model: nn.Module, data: ClientData) -> tuple[Tensor, Tensor]:
        """(features, labels) of every local training sample: one more pass, eval mode, no augmentation."""
        was_training = model.training
        model.eval()
        try:
            out = []
            for b in data.plain_batches():
                with autocast_for(b.x):
                    out.append((model.features(b.x).float(), b.y))
        finally:
            model.train(was_training)
        return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])

    def upload(self, model: nn.Module, cid: int, data: ClientData, stats: dict[str, float]) -> Payload:
        """Per class the mean representation and the label (never a tensor of the model)."""
        reps, labels = self.representations(model, data)
        means, classes = class_means(reps, labels, self.method.num_classes)
        return {"protos": means, "labels": classes}


class FedGHServer(Strategy):
    """Trains the global head on the uploaded per-class representations."""

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """``server_epochs`` of SGD on H_g over every (mean representation, label) pair of the round."""
        if not results:
            return state
        p = self.params
        reps = torch.cat([r.uplink["protos"] for r in results])
        labels = torch.cat([r.uplink["labels"] for r in results])
        head = {k: v.to(reps.device) for k, v in state["model"].items()}
        g = torch.Generator().manual_seed(stream_seed(info.seed, info.round, 0, SERVER_STREAM))
        new = train_head(head, reps, labels, float(p["server_lr"]), int(p["server_epochs"]),
                         int(p["server_batch_size"]), g)
        return {**state, "model": new}


@register_method
class FedGH(GlobalHeadMethod):
    """Heterogeneous whole models; the server trains one global head on per-class mean representations."""

    name = "fedgh"
    defaults: dict[str, Any] = {
        **GlobalHeadMethod.defaults,
        "server_lr": 0.01,          # HtFLlib
        "server_epochs": 1,         # HtFLlib
        "server_batch_size": 16,    # HtFLlib: the local batch size (spec §2: 16)
    }
    param_rules = {
        **GlobalHeadMethod.param_rules,
        "server_lr": Number(0.0, lo_open=True),
        "server_epochs": Int(0),
        "server_batch_size": Int(1),
    }
    client_role = FedGHClient
    strategy_role = FedGHServer


__all__ = ["FedGH", "class_means", "train_head"]
