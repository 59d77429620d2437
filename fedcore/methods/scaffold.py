"""SCAFFOLD (Karimireddy et al., ICML 2020), option II control variates, on the entire model."""
from __future__ import annotations

import dataclasses

from typing import Sequence

import torch
from torch import Tensor, nn

from fedcore.constraints import Flag, Number
from fedcore.engine.aggregation import normalized_weights, weighted_average
from fedcore.engine.optim import ClientData, TrainSettings, optimizer_spec, run_epochs
from fedcore.engine.roles import Client, FitResult, Payload, RoundInfo, State, Strategy, module_state
from fedcore.methods import register_method
from fedcore.methods.base import WholeModelMethod


def corrected(loss: Tensor, params: Sequence[Tensor], correction: Sequence[Tensor]) -> Tensor:
    """``loss`` whose gradient w.r.t. each parameter gains ``correction`` (c − c_i); its value is unchanged."""
    return loss + sum(((p - p.detach()) * d).sum() for p, d in zip(params, correction, strict=True))


def option_two(c_i: State, c: State, x: State, y: State, steps: int, lr: float) -> State:
    """SCAFFOLD's option II: c_i⁺ = c_i − c + (x − y_i) / (K η_l)."""
    return {k: c_i[k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in y}


def _or_zeros(control: State, like: State) -> State:
    """The control variate, zeros where none was set yet (before a client's or the server's first update)."""
    return {k: control[k] if k in control else torch.zeros_like(v) for k, v in like.items()}


class ScaffoldClient(Client):
    """Local steps on CE with the gradient corrected by c − c_i; uploads Δy, Δc and its BatchNorm buffers and
    keeps c_i (its complete state)."""

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], dict | None]:
        """E epochs of the corrected steps; stats add ``steps`` (K, the number of local steps)."""
        keys = self.method.trainable_keys(cid)
        named = dict(model.named_parameters())
        params = [named[k] for k in keys]
        like = {k: named[k].detach() for k in keys}
        c, c_i = _or_zeros(downlink.get("control", {}), like), _or_zeros(state.get("control", {}), like)
        correction = [(c[k] - c_i[k]).to(named[k].device) for k in keys]
        steps = [0]

        def loss_fn(batch) -> Tensor:
            steps[0] += 1
            return corrected(self.loss(model, batch), params, correction)

        if self.params["plain_sgd"]:  # the steps option II's c_i⁺ assumes (see the class doc)
            settings = dataclasses.replace(settings, optimizer={**settings.optimizer, "momentum": 0.0})
        stats, opt_state = run_epochs(params, data, settings, settings.local_epochs, loss_fn)
        return {**stats, "steps": float(steps[0])}, opt_state

    def fit(self, cid: int, state: Payload, downlink: Payload, data: ClientData,
            settings: TrainSettings) -> tuple[Payload, FitResult]:
        """Start, train, then option II's c_i⁺ and the uplink (Δy_i = y_i − x, Δc_i = c_i⁺ − c_i, buffers)."""
        model = self.method.model_for(cid)
        self.start(model, cid, state, downlink)
        stats, _ = self.train(model, cid, state, downlink, data, settings)
        steps = int(stats["steps"])
        if steps == 0:
            raise ValueError(f"scaffold: client {cid} took no local step (no batches), so option II's "
                             "(x - y_i) / (K lr) is undefined")
        keys = self.method.trainable_keys(cid)
        y = module_state(model, keys)
        x = {k: downlink["model"][k].to(y[k].device) for k in keys}
        c, c_i = _or_zeros(downlink.get("control", {}), y), _or_zeros(state.get("control", {}), y)
        new_c_i = option_two(c_i, c, x, y, steps, float(optimizer_spec(settings.optimizer).lr))
        buffers = [k for k in self.shared_keys(self.method.keys(cid)) if k not in set(keys)]
        uplink = {"delta": {k: y[k] - x[k] for k in keys}, "delta_control": {k: new_c_i[k] - c_i[k] for k in keys},
                  "buffers": module_state(model, buffers)}
        new_state = {**state, "model": module_state(model, self.personal_keys(self.method.keys(cid))),
                     "control": new_c_i}
        return new_state, FitResult(cid, data.num_samples, uplink, stats)


class ScaffoldServer(Strategy):
    """x ← x + η_g Σ_i w_i Δy_i, c ← c + (1/N) Σ_i Δc_i, BatchNorm buffers averaged as FedAvg."""

    def init_state(self, num_clients: int) -> Payload:
        """The initial global model and c = 0 (kept implicit until the first update)."""
        return {**super().init_state(num_clients), "control": {}}

    def configure(self, state: Payload, cid: int) -> Payload:
        """The global model and the global control variate."""
        return {"model": state["model"], "control": state["control"]}

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """The SCAFFOLD server update, Δy weighted by sample count (w_i = n_i / Σ n)."""
        if not results:
            return state
        weights = normalized_weights([float(r.num_samples) for r in results])
        eta = float(self.params["server_lr"])
        model = dict(state["model"])
        for k in results[0].uplink["delta"]:
            step = sum(w * r.uplink["delta"][k].double() for w, r in zip(weights, results, strict=True))
            model[k] = (model[k].to(step.device, torch.float64) + eta * step).to(model[k].dtype)
        buffers = list(results[0].uplink["buffers"])
        if buffers:
            model.update(weighted_average([r.uplink["buffers"] for r in results], weights, names=buffers))
        deltas = {k: sum(r.uplink["delta_control"][k] for r in results) for k in results[0].uplink["delta_control"]}
        control = _or_zeros(state["control"], deltas)
        control = {k: control[k].to(d.device) + d / info.num_clients for k, d in deltas.items()}
        return {**state, "model": model, "control": control}


@register_method
class Scaffold(WholeModelMethod):
    """SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh; ICML 2020), option II, on the entire model.

    Each client trains the entire model (``init`` pretrained or a random draw; FedHPL spec §8.15: random) for
    E epochs; every step's gradient is corrected by c − c_i (global and client control variates, zero at
    start). After K local steps at learning rate η_l the client sets c_i⁺ = c_i − c + (x − y_i)/(K η_l)
    (option II) and uploads Δy_i = y_i − x and Δc_i = c_i⁺ − c_i (twice the model's parameters) plus its
    BatchNorm buffers; c_i is part of the client's complete state (checkpointed every round). The server sets
    x ← x + η_g Σ_i w_i Δy_i, c ← c + (1/N) Σ_{i∈S} Δc_i (N = all clients) and averages the buffers by sample
    count as FedAvg. The global model is evaluated (a loss-based method, FedHPL spec §3.3).

    Choices where the papers are silent:
    * η_g = 1 (``server_lr``), SCAFFOLD's experiments and PFLlib's default; FedHPL states none (spec §2).
    * Δy is weighted by sample count, w_i = n_i / Σ n (the paper: 1/|S|), so that with c ≡ 0 and η_g = 1
      the update is this project's FedAvg; c keeps the paper's 1/N.
    * Local steps are plain SGD (``plain_sgd: true``: the experiment's lr and weight decay, momentum 0), the steps
      option II's c_i⁺ = c_i − c + (x − y_i)/(K η_l) is derived for, as in the SCAFFOLD paper and PFLlib. With
      the experiment's momentum 0.9 (``plain_sgd: false``) (x − y_i)/(K η_l) overstates the gradient about 10x,
      the control variates grow every round and the run diverged at mini (loss 7e5 by round 10, then NaN).
      The correction enters the gradient before the optimiser (weight decay then acts on g − c_i + c).
    * Control variates cover the trainable parameters; BatchNorm's running statistics have none.
    * The logged train loss is CE (the correction changes the gradient, not the loss's value).
    """

    name = "scaffold"
    defaults = {**WholeModelMethod.defaults, "server_lr": 1.0, "plain_sgd": True}
    param_rules = {**WholeModelMethod.param_rules, "server_lr": Number(0.0, lo_open=True), "plain_sgd": Flag()}
    client_role = ScaffoldClient
    strategy_role = ScaffoldServer
