"""FedGen: data-free knowledge distillation with a feature generator (Zhu, Hong, Zhou; ICML 2021), as HtFLlib runs it
on heterogeneous models (FedHPL Table 2, spec fedhpl §5).

Model. Every client trains its entire model (``WholeModelMethod``: its own ResNet, random init at paper scale,
``common_dim`` so that all heads read one feature width) behind one global linear head (``GlobalHeadMethod``).

Server generator. G(z, y) -> feature: [z, one_hot(y)] -> Linear(noise_dim + C, hidden_dim) -> BatchNorm (batch
statistics) -> ReLU -> Linear(hidden_dim, feature_dim), z ~ U[0, 1)^noise_dim (FedGen's and HtFLlib's noise).

Client update (CE + FedGen's regulariser on the head). Per batch:
CE(f_k(x), y) + CE(h_k(G(z, ŷ)), ŷ), with ``generator_batch_size`` labels ŷ drawn with replacement in proportion
to the label counts of all clients and fresh noise z, G frozen (no gradient reaches it); the regulariser acts
through the head only, and only once the server has trained G (round 1 is CE only). Optimiser: the experiment's
(FedHPL §2: SGD, momentum 0.9, weight decay), fresh each round (HtFLlib: a fresh plain SGD at the same lr).

Upload. The trained head (C·d + C: 5130 at d = 512, C = 10) and the client's label counts n_{k,c} (C numbers;
Table 9 counts them as |D_k| labels).

Server. (1) The global head is the sample-weighted average of the uploaded heads (HtFLlib). (2) G is trained
data-free for ``generator_steps`` Adam steps (lr ``generator_lr``): labels ŷ drawn in proportion to the round's
uploaded label counts, loss CE(Σ_k w_{k,ŷ} h_k(G(z, ŷ)), ŷ), the ensemble of the uploaded heads weighted by label
counts, w_{k,c} = n_{k,c} / Σ_j n_{j,c} (``teacher_weights: labels``), or by sample counts, w_k = n_k / Σ_j n_j
(``samples``, HtFLlib). Server state: global head, G, G's Adam state (kept across rounds:
``keep_generator_optimizer``), every client's latest label counts; all checkpointed every round.
Downlink: the global head, G and the label counts summed over clients (the label space).

Evaluation (spec §3.3): each client's own extractor with the global head (personalised), on the full test set.

Choices where the paper (and FedHPL) is silent, recorded in DEVIATIONS.md (FedHPL baselines, FedGen):
* HtFLlib's heterogeneous FedGen, not the original (whose G feeds a model shared by all): G works in the heads'
  feature space; the regulariser is HtFLlib's CE on the head, not FedGen's KL with annealed weights; no diversity
  loss; the head is averaged and replaces every client's head each round (HtFLlib sends it).
* ``noise_dim`` 512, not HtFLlib's tuned 32: with hidden 512 and feature 512 it gives Table 9's G of 0.507 M
  (C = 10) and 0.551 M (C = 100) exactly (HtFLlib's default noise_dim), 32 gives 0.272 M / 0.316 M.
* Round 1 is CE only (the original FedGen regularises from round 2 on); HtFLlib already regularises in round 1
  with the untrained G. HtFLlib's stored ``servergen.py`` never saves G after training it, so its clients use the
  initial, untrained G in every round (and its server restarts from it); PFLlib's FedGen and FedGen's code keep
  the trained G, as we do.
* Teacher weights by label count (FedGen paper); HtFLlib weighs by sample count (``teacher_weights: samples``).
* The server's loss is CE of the weighted ensemble of the heads' logits (HtFLlib, PFLlib; the FedGen paper's
  objective). FedGen's code instead sums each teacher's CE weighted by w_{k,y}, adds a diversity loss and draws
  its labels uniformly over the labels some selected client saw while training; we draw in proportion to the
  label counts (HtFLlib) and add no diversity loss.
* G's Adam state persists across rounds (FedGen's server and PFLlib keep one optimiser); HtFLlib makes a fresh
  one each round (``keep_generator_optimizer: false``).
* FedGen's code also (tests/test_official_fedgen.py): its teacher loss is Σ_k mean_b(w_{k,y_b})·mean_b CE_k (a
  (B,) x (B, 1) broadcast), w from label counts that start at 1 and count every local epoch; its clients draw ŷ
  uniformly over the labels present and add β_t·KL(softmax(h(G(z, y))) ‖ p(x)) on the batch's own labels, α_t and
  β_t = max(1e-4, ·0.98^t); G's Adam has weight decay 1e-2 and its lr decays 0.98 a round, the clients' lr 0.99 a
  round; it averages, sends and scores the whole model (parameters; BatchNorm statistics stay with each client).
  We keep the libraries' G optimiser (no weight decay, constant lr: HtFLlib, PFLlib's default) and constant lrs.
* The server draws its labels from the round's uploaders only (every drawn label has a teacher); the clients
  draw from every client's counts known to the server.
* ``generator_batch_size`` 16 for the server's steps and the client's regulariser (HtFLlib: the local batch
  size; spec §2: bs 16); G's BatchNorm always uses batch statistics (HtFLlib keeps G in train mode; FedGen's
  code puts G in eval mode on the clients, so their regulariser reads G's running statistics).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Choice, Flag, Int, Number
from fedcore.engine.aggregation import add_counts, weighted_average
from fedcore.engine.data import Batch, on_device
from fedcore.engine.optim import ClientData, TrainSettings, run_epochs
from fedcore.engine.roles import FitResult, Payload, RoundInfo, Strategy, load_state, module_state
from fedcore.engine.sampling import stream_seed
from fedcore.methods import register_method
from fedcore.methods.global_head import GlobalHeadClient, GlobalHeadMethod, head_keys

TEACHER_WEIGHTS = ("labels", "samples")
SERVER_STREAM = 101  # stream_seed stream of the server's generator training (clients use 0..3)


class Generator(nn.Module):
    """G(z, y) -> a feature the heads read: [z, one_hot(y)] -> Linear -> BatchNorm -> ReLU -> Linear."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.fc1 = nn.Linear(noise_dim + num_classes, hidden_dim)
        self.bn = nn.BatchNorm1d(hidden_dim, track_running_stats=False)  # always batch statistics, as HtFLlib's G
        self.fc2 = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: Tensor, noise: Tensor) -> Tensor:
        """Features for ``labels`` (B,) from ``noise`` (B, noise_dim)."""
        y = F.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.fc2(F.relu(self.bn(self.fc1(torch.cat([noise, y], dim=1)))))

    def noise(self, n: int, device: torch.device, generator: torch.Generator | None = None) -> Tensor:
        """z ~ U[0, 1)^noise_dim (FedGen's and HtFLlib's draw)."""
        return torch.rand(n, self.noise_dim, device=device, generator=generator)


# ---- the rules ------------------------------------------------------------------------------------------
def sample_labels(counts: Tensor, n: int, generator: torch.Generator | None = None) -> Tensor:
    """``n`` labels drawn with replacement in proportion to ``counts`` (C,)."""
    return torch.multinomial(counts.double(), n, replacement=True, generator=generator)


def teacher_weights(counts: Tensor, samples: Tensor, labels: Tensor, mode: str) -> Tensor:
    """(B, K) weight of each uploaded head for each generated sample: n_{k,y}/Σ_j n_{j,y} or n_k/Σ_j n_j."""
    if mode == "labels":
        per_class = counts / counts.sum(0, keepdim=True)        # (K, C); a drawn label has some count
        return per_class[:, labels].T
    if mode == "samples":
        return (samples / samples.sum()).expand(len(labels), -1)
    raise ValueError(f"teacher_weights must be one of {list(TEACHER_WEIGHTS)}, got {mode!r}")


def ensemble_logits(features: Tensor, weights: Tensor, heads: Sequence[dict[str, Tensor]]) -> Tensor:
    """Σ_k w_{b,k} (features_b W_k^T + b_k): the uploaded linear heads' weighted ensemble (B, C)."""
    w = torch.stack([h["head.weight"] for h in heads])            # (K, C, d)
    b = torch.stack([h["head.bias"] for h in heads])              # (K, C)
    per_head = torch.einsum("bd,kcd->bkc", features, w) + b       # (B, K, C)
    return (weights[..., None] * per_head).sum(1)


def generator_loss(features: Tensor, labels: Tensor, weights: Tensor, heads: Sequence[dict[str, Tensor]]) -> Tensor:
    """The server's data-free objective: CE of the weighted head ensemble on generated features."""
    return F.cross_entropy(ensemble_logits(features, weights, heads), labels)


def regularised_loss(logits: Tensor, labels: Tensor, head_logits: Tensor | None, gen_labels: Tensor | None) -> Tensor:
    """The client's batch loss: CE on its data + CE of its head on generated features (when G exists)."""
    loss = F.cross_entropy(logits, labels)
    if head_logits is not None:
        loss = loss + F.cross_entropy(head_logits, gen_labels)
    return loss


# ---- roles ------------------------------------------------------------------------------------------------
class FedGenClient(GlobalHeadClient):
    """CE + the generator regulariser on the head; uploads the head and its label counts."""

    def fit(self, cid: int, state: Payload, downlink: Payload, data: ClientData,
            settings: TrainSettings) -> tuple[Payload, FitResult]:
        """Start, train with G, finish; the uplink also carries the labels counted during training."""
        model = self.method.model_for(cid)
        self.start(model, cid, state, downlink)
        device = next(model.parameters()).device
        gen = self.method.loaded_generator(downlink.get("generator"), device)
        space = downlink.get("label_counts")
        seen = torch.zeros(self.method.num_classes, dtype=torch.long, device=device)
        bs = int(self.params["generator_batch_size"])

        def loss(batch: Batch) -> Tensor:
            add_counts(seen, batch.y)  # counted while training: no extra pass
            head_logits = gen_labels = None
            if gen is not None:
                gen_labels = on_device(sample_labels(space, bs), batch.y)
                with torch.no_grad():
                    z = gen(gen_labels, gen.noise(bs, batch.y.device))
                head_logits = model.head(z).float()
            return regularised_loss(model(batch.x).float(), batch.y, head_logits, gen_labels)

        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        stats, _ = run_epochs(params, data, settings, settings.local_epochs, loss)
        new_state, result = self.finish(model, cid, state, data, stats, None)
        result.uplink["label_counts"] = (seen // max(settings.local_epochs, 1)).float()
        return new_state, result


class FedGenServer(Strategy):
    """Averages the heads and trains G data-free against the uploaded heads' ensemble."""

    def init_state(self, num_clients: int) -> Payload:
        """Client 0's initial head as the global head (HtFLlib), G as drawn at build, no label counts yet."""
        state = super().init_state(num_clients)
        gen = self.method.generator
        return {**state, "generator": module_state(gen, list(gen.state_dict())), "generator_optimizer": {},
                "label_counts": torch.zeros(num_clients, self.method.num_classes),
                "generator_trained": torch.tensor(False)}

    def configure(self, state: Payload, cid: int) -> Payload:
        """The global head; once G was trained, G and the label space (counts summed over clients)."""
        down: Payload = {"model": state["model"]}
        if bool(state["generator_trained"]):
            down["generator"] = state["generator"]
            down["label_counts"] = state["label_counts"].sum(0)
        return down

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """Sample-weighted head average, then ``generator_steps`` Adam steps on G."""
        if not results:
            return state
        p = self.params
        heads = [r.uplink["model"] for r in results]
        head = weighted_average(heads, [float(r.num_samples) for r in results], names=list(state["model"]))
        counts = state["label_counts"].to(results[0].uplink["label_counts"].device).clone()
        for r in results:
            counts[r.cid] = r.uplink["label_counts"].to(counts.device)
        round_counts = torch.stack([r.uplink["label_counts"] for r in results]).float()
        device = round_counts.device
        samples = torch.tensor([float(r.num_samples) for r in results], device=device)
        gen = self.method.loaded_generator(state["generator"], device)
        opt = torch.optim.Adam(gen.parameters(), lr=float(p["generator_lr"]), betas=(0.9, 0.999), eps=1e-8)
        if p["keep_generator_optimizer"] and state["generator_optimizer"]:
            opt.load_state_dict(state["generator_optimizer"])
            for s in opt.state.values():  # a resumed checkpoint comes back on the device: Adam keeps steps on the CPU
                s["step"] = s["step"].cpu()
        g = torch.Generator(device=device).manual_seed(stream_seed(info.seed, info.round, 0, SERVER_STREAM))
        bs = int(p["generator_batch_size"])
        heads = [{k: v.detach().float() for k, v in h.items()} for h in heads]
        for _ in range(int(p["generator_steps"])):
            labels = sample_labels(round_counts.sum(0), bs, g)
            weights = teacher_weights(round_counts, samples, labels, p["teacher_weights"])
            loss = generator_loss(gen(labels, gen.noise(bs, device, g)), labels, weights, heads)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return {**state, "model": head, "generator": module_state(gen, list(state["generator"])),
                "generator_optimizer": opt.state_dict() if p["keep_generator_optimizer"] else {},
                "label_counts": counts, "generator_trained": torch.tensor(True)}


@register_method
class FedGen(GlobalHeadMethod):
    """Heterogeneous whole models, a global head, and a server generator that regularises the heads."""

    name = "fedgen"
    defaults: dict[str, Any] = {
        **GlobalHeadMethod.defaults,
        "noise_dim": 512,                  # Table 9's G (0.507 M / 0.551 M); HtFLlib's tuned value is 32
        "hidden_dim": 512,                 # HtFLlib
        "generator_lr": 0.1,               # HtFLlib (Adam)
        "generator_steps": 100,            # HtFLlib server_epochs: Adam steps of G per round
        "generator_batch_size": 16,        # server steps and the client's regulariser (HtFLlib: the batch size)
        "teacher_weights": "labels",       # labels (FedGen) | samples (HtFLlib)
        "keep_generator_optimizer": True,  # G's Adam state across rounds (false: HtFLlib's fresh one)
    }
    param_rules = {
        **GlobalHeadMethod.param_rules,
        "noise_dim": Int(1),
        "hidden_dim": Int(1),
        "generator_lr": Number(0.0, lo_open=True),
        "generator_steps": Int(0),
        "generator_batch_size": Int(2),     # BatchNorm needs two samples
        "teacher_weights": Choice(TEACHER_WEIGHTS),
        "keep_generator_optimizer": Flag(),
    }
    client_role = FedGenClient
    strategy_role = FedGenServer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        p = self.params
        self.generator = Generator(int(p["noise_dim"]), self.num_classes, int(p["hidden_dim"]), self.feature_dim)

    def loaded_generator(self, state: dict[str, Tensor] | None, device: torch.device) -> Generator | None:
        """The method's G on ``device`` holding ``state``, or None when there is none."""
        if state is None:
            return None
        gen = self.generator.to(device).train()
        load_state(gen, state)
        return gen


__all__ = ["FedGen", "Generator", "ensemble_logits", "generator_loss", "head_keys", "regularised_loss",
           "sample_labels", "teacher_weights"]
