"""FedCAC (Wu et al., ICCV 2023): per-parameter critical sets; critical parameters come from a customised global
model of the clients with overlapping critical sets, the others from the global model."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from fedcore.constraints import Int, Number
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import Client, FitResult, Payload, RoundInfo, State, Strategy, load_state, module_state
from fedcore.methods import register_method
from fedcore.methods.base import PersonalEvaluator, WholeModelMethod


@torch.no_grad()
def critical_mask(before: Tensor, after: Tensor, tau: float) -> Tensor:
    """One tensor's critical parameters (bool, its shape): sensitivity |(θ_after − θ_before) · θ_after| at or above
    the ⌊τ·n⌋-th largest; a zero threshold is replaced by the smallest nonzero sensitivity; ⌊τ·n⌋ = 0 selects
    nothing (the official ``evaluate_critical_parameter``, ties included)."""
    c = ((after - before) * after).abs().float()
    flat = c.reshape(-1)
    nz = int(tau * flat.numel())
    thresh = torch.topk(flat, nz).values[-1] if nz > 0 else torch.tensor(math.inf, device=c.device)
    if thresh <= 1e-10:
        nonzero = flat[flat > 1e-20]
        if len(nonzero):
            thresh = nonzero.min()
    return c >= thresh


def overlap_rates(masks: list[Tensor], chunk: int = 1 << 20) -> Tensor:
    """(n, n) float64: rate[i, j] = 1 − |c_i − c_j|₁ / (2·|c_i|₁) for the flat critical sets c (the official
    ``overlap_rate``; not symmetric), from Gram sums over column chunks (each chunk's counts exact in float32)."""
    n, total = len(masks), masks[0].numel()
    gram = torch.zeros(n, n, dtype=torch.float64, device=masks[0].device)
    for s in range(0, total, chunk):
        block = torch.stack([m[s:s + chunk] for m in masks]).float()
        gram += (block @ block.T).double()
    size = gram.diagonal()
    diff = size[:, None] + size[None, :] - 2 * gram
    return 1 - diff / (2 * size[:, None])


def collaborators(rates: Tensor, round_idx: int, beta: float) -> list[list[int]]:
    """Per client i (row order) the positions of the clients whose critical parameters it averages: itself and
    every j with rate[i, j] ≥ mean + (round/β)·(max − mean) (mean and max over the off-diagonal entries)."""
    n = rates.shape[0]
    if n == 1:
        return [[0]]
    off = ~torch.eye(n, dtype=torch.bool, device=rates.device)
    vals = rates[off]
    mean, top = vals.mean(), vals.max()
    threshold = mean + round_idx / beta * (top - mean)
    return [[j for j in range(n) if j == i or bool(rates[i, j] >= threshold)] for i in range(n)]


class FedCACClient(Client):
    """Starts from (critical: customised global, others: global) parameters and its own BatchNorm statistics;
    after E epochs of CE it selects its critical parameters and uploads its parameters and the critical set."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The parameters (the official code mixes and averages named_parameters only)."""
        return [k for k in keys if k in self.method.param_names]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The buffers (BatchNorm statistics): never replaced after the start, as in the official code."""
        return [k for k in keys if k not in self.method.param_names]

    def start(self, model: nn.Module, cid: int, state: Payload, downlink: Payload) -> None:
        """Global parameters, critical ones from the customised model (once the client has a critical set), then
        the client's own buffers."""
        start = dict(downlink.get("model", {}))
        custom, mask = downlink.get("customized"), state.get("critical")
        if custom is not None and mask is not None:
            for k, m in self.method.split_mask(cid, mask).items():
                start[k] = torch.where(m, custom[k], start[k])
        load_state(model, start)
        load_state(model, state.get("model", {}))

    def fit(self, cid: int, state: Payload, downlink: Payload, data: ClientData,
            settings: TrainSettings) -> tuple[Payload, FitResult]:
        """Start, E epochs of CE over every parameter, then the critical set (round start to round end), which
        joins the client's state and its upload."""
        model = self.method.model_for(cid)
        self.start(model, cid, state, downlink)
        keys = self.method.trainable_keys(cid)
        before = module_state(model, keys)
        stats, opt_state = self.train(model, cid, state, downlink, data, settings)
        named, tau = dict(model.named_parameters()), float(self.params["tau"])
        critical = torch.cat([critical_mask(before[k], named[k].detach(), tau).reshape(-1) for k in keys])
        stats["critical_fraction"] = float(critical.float().mean())
        new_state, res = self.finish(model, cid, state, data, stats, opt_state)
        new_state["critical"] = critical
        res.uplink["critical"] = critical
        return new_state, res


class FedCACStrategy(Strategy):
    """Global model = sample-weighted mean of the uploaded parameters; per client a customised model = the plain
    mean of the last uploads of itself and its collaborators (overlapping critical sets)."""

    def init_state(self, num_clients: int) -> Payload:
        """The initial parameters; no upload yet."""
        return {**super().init_state(num_clients), "uploads": {}, "critical": {}, "collaborators": {}}

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """FedAvg of the round's uploads; then every client's collaborators among all clients with an upload
        (a client keeps its last one)."""
        if not results:
            return state
        new = super().aggregate(info, state, results)
        uploads = {**state["uploads"], **{r.cid: r.uplink["model"] for r in results}}
        critical = {**state["critical"], **{r.cid: r.uplink["critical"] for r in results}}
        cids = sorted(critical)
        groups = collaborators(overlap_rates([critical[c] for c in cids]), info.round, float(self.params["beta"]))
        together = {c: [cids[j] for j in g] for c, g in zip(cids, groups, strict=True)}
        return {**new, "uploads": uploads, "critical": critical, "collaborators": together}

    def configure(self, state: Payload, cid: int) -> Payload:
        """The global parameters and, once the client has collaborators, its customised model."""
        down: Payload = {"model": state["model"]}
        group = state["collaborators"].get(cid)
        if group:
            ups = [state["uploads"][c] for c in group]
            down["customized"] = customised_model(ups)
        return down


def customised_model(uploads: list[State]) -> State:
    """The plain (unweighted) mean of the given uploads, key by key (the official customised global model)."""
    return {k: torch.stack([u[k].double() for u in uploads]).mean(0).to(uploads[0][k].dtype) for k in uploads[0]}


@register_method
class FedCAC(WholeModelMethod):
    """FedCAC (Wu, Liu, Niu, Zhu, Tang; "Bold but Cautious: Unlocking the Potential of Personalized Federated
    Learning through Cautiously Aggressive Collaboration", ICCV 2023; official code FLAIR-Community/Fling's
    ``fedcac_client``/``fedcac_group``) on the entire model.

    Each client trains every parameter for E epochs with CE. Its critical parameters: per parameter tensor the
    top ``tau`` fraction by sensitivity |(θ_end − θ_start) ⊙ θ_end| (θ_start = its model at the start of the
    round). It uploads its parameters and its critical set. The server averages the parameters by sample count
    (the global model) and, for every pair, computes the overlap rate 1 − ‖c_i − c_j‖₁ / (2‖c_i‖₁); client j
    collaborates with client i when its rate ≥ mean + (t/β)·(max − mean) (over all pairs i ≠ j, t = the round),
    so collaboration on critical parameters fades as t approaches β. Client i's customised model is the plain
    mean of its own and its collaborators' uploads. Next round (and at evaluation, after aggregation) client i
    starts from its critical parameters taken from its customised model and the rest from the global model.

    Hyperparameters: ``tau`` 0.5 and ``beta`` 100 (CIFAR-10), 0.4 and 170 (CIFAR-100): Fling's
    ``flzoo/cifar{10,100}/*_fedcac_resnet_config.py`` (FedPFT spec External references); the defaults here are
    CIFAR-10's.

    As the official code, and where it is silent:
    * Only parameters are mixed, averaged and uploaded: BatchNorm running statistics stay each client's own
      after the common start (the official sync replaces ``named_parameters`` only).
    * The threshold's t counts aggregations from 1 (Fling: ``(epoch + 1) / beta`` with epoch 0 at the first).
      PFLlib's ``servercac`` uses the same t from its second aggregation on, but builds no customised model at
      its first (``send_models`` skips ``epoch`` 0), so its round 2 starts every client's critical parameters
      from the initial model (``customized_model`` as constructed); ours (and Fling's) from the customised one.
    * The global model is weighted by sample count (Fling's ``fed_avg``), the customised ones are plain means.
    * With partial participation a client keeps its last upload and critical set at the server (Fling re-uses
      every client's current model; PFLlib only the round's clients: overlaps and customised models among them,
      every other client keeps its last mask and customised model); a client that never trained starts from the
      global model. FedPFT runs FedCAC at full participation, where all agree.
    """

    name = "fedcac"
    defaults = {**WholeModelMethod.defaults, "tau": 0.5, "beta": 100}
    param_rules = {**WholeModelMethod.param_rules, "tau": Number(0.0, 1.0, lo_open=True), "beta": Int(1)}
    client_role = FedCACClient
    strategy_role = FedCACStrategy
    evaluator_role = PersonalEvaluator

    @property
    def param_names(self) -> set[str]:
        """Names of the trainable parameters of any client model."""
        return {k for ks in self._trainable for k in ks}

    def split_mask(self, cid: int, flat: Tensor) -> dict[str, Tensor]:
        """A flat critical set cut back into per-parameter masks (``trainable_keys`` order)."""
        named = dict(self.model_for(cid).named_parameters())
        out, pos = {}, 0
        for k in self.trainable_keys(cid):
            n = named[k].numel()
            out[k] = flat[pos:pos + n].reshape(named[k].shape)
            pos += n
        if pos != flat.numel():
            raise ValueError(f"fedcac: a critical set of {flat.numel()} entries for a model of {pos} parameters")
        return out
