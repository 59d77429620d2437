"""Per-FedAvg (first-order): MAML-style local steps on VPT-shallow prompts + head, FedAvg, one adaptation step."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Int, Number
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings, autocast_for, make_optimizer, optimizer_spec
from fedcore.engine.roles import Client, Evaluator, Payload
from fedcore.methods import register_method
from fedcore.methods.base import PromptMethod


def halves(x: Tensor, y: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The inner batch D and the outer batch D' of one minibatch: its two halves (a single sample serves both)."""
    if len(y) < 2:
        return (x, y), (x, y)
    h = len(y) // 2
    return (x[:h], y[:h]), (x[h:], y[h:])


def grads(model: nn.Module, params: list[nn.Parameter], x: Tensor, y: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
    """Gradients of the batch cross-entropy w.r.t. ``params`` and the (detached) loss."""
    with autocast_for(x):
        loss = F.cross_entropy(model(x).float(), y)
    return torch.autograd.grad(loss, params), loss.detach()


class PerFedAvgClient(Client):
    """E epochs of first-order MAML steps; everything is shared."""

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], None]:
        """First-order Per-FedAvg steps; returns the mean loss at the adapted points."""
        alpha = float(self.params["alpha"])
        beta = optimizer_spec(settings.optimizer).lr if self.params["beta"] is None else float(self.params["beta"])
        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        opt = make_optimizer(params, {**settings.optimizer, "lr": beta})
        total, count = None, 0
        for _ in range(settings.local_epochs):
            for batch in data.batches():
                (x1, y1), (x2, y2) = halves(batch.x, batch.y)
                inner, _ = grads(model, params, x1, y1)
                start = [p.detach().clone() for p in params]
                with torch.no_grad():
                    for p, g in zip(params, inner, strict=True):
                        p.sub_(alpha * g)                        # temporary adapted point w'
                outer, loss = grads(model, params, x2, y2)
                with torch.no_grad():
                    for p, w, g in zip(params, start, outer, strict=True):
                        p.copy_(w)                               # the meta-step is applied at w, not w'
                        p.grad = g
                opt.step()
                opt.zero_grad(set_to_none=True)
                step = loss.double() * len(y2)
                total = step if total is None else total + step
                count += len(y2)
        return {"loss": float(total) / count if count else float("nan")}, None


class PerFedAvgEvaluator(Evaluator):
    """Each client adapts the global model with ``eval_steps`` plain SGD steps on its own training batches."""

    personalized = True

    def load(self, model: nn.Module, cid: int | None, server: Payload, client_state: Payload | None,
             data: ClientData | None) -> None:
        """The global model, then (for a client) ``eval_steps`` SGD steps of size alpha on its batches."""
        super().load(model, cid, server, client_state, data)
        if cid is None:
            return
        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        batches = cycle(data)
        with torch.enable_grad():
            for _ in range(int(self.params["eval_steps"])):
                b = next(batches)
                g, _ = grads(model, params, b.x, b.y)
                with torch.no_grad():
                    for p, gi in zip(params, g, strict=True):
                        p.sub_(float(self.params["alpha"]) * gi)


def cycle(data: ClientData) -> Iterator[Batch]:
    """The client's batches, starting a new pass whenever one ends (more eval steps than batches)."""
    while True:
        empty = True
        for batch in data.batches():
            empty = False
            yield batch
        if empty:
            raise ValueError(f"per_fedavg: client {data.cid} has no training batches to adapt on")


@register_method
class PerFedAvg(PromptMethod):
    """Per-FedAvg (Fallah, Mokhtari, Ozdaglar; NeurIPS 2020), first-order (FO) variant, on VPT-shallow + head.

    Local update (E epochs): each minibatch of the experiment's size B is split into two halves D and D';
    the client takes a temporary inner step w' = w - alpha * grad f(w; D) (plain SGD), evaluates the gradient
    at the adapted point, grad f(w'; D'), and applies it to the un-adapted w with the experiment's optimiser
    at learning rate beta (Per-FedAvg FO: w <- w - beta * grad f(w - alpha grad f(w; D); D')). The server
    averages prompts and head by sample count (FedAvg). Evaluation (``PerFedAvgEvaluator.load``): every client adapts the
    current global model with ``eval_steps`` (default 1) plain SGD steps of size alpha on batches of its own
    training data, then is scored with that personalised model (the paper's one-step personalisation).

    Choices where the paper is silent or our setting differs:
    * FO, not the Hessian-free variant: HF needs a Hessian-vector product through the frozen ViT (double
      backward, about 2x the cost of a step) and a third batch; FO is what common code bases run (e.g. PFLlib).
    * D and D' are the halves of one experiment-sized minibatch (PFLlib draws a 2B batch and halves it); we
      keep B so each epoch is one pass over the data with as many outer steps as FedVPT takes.
    * alpha = 0.01 (SGPT's code lr for every experiment, spec 2): one adaptation step is the size of one of
      the experiment's plain SGD steps. beta = the experiment's lr (default ``beta: null``), applied through
      the experiment's optimiser (momentum, weight decay), so the outer update is exactly FedVPT's step
      taken at the adapted point; the inner and evaluation steps are plain SGD, as in MAML.
    * The reported train loss is the meta-objective f(w'; D') (loss at the adapted point).
    * E epochs of meta-steps a round (the paper's τ local steps). PFLlib's server calls each client's ``train()``
      twice a round (``serverperavg.py:35-36``): 2E epochs there. Its evaluation adapts on one batch of B samples
      (``load_train_data(self.batch_size)``, half its 2B training draw); ours on one batch of the experiment's
      size. Otherwise equal to PFLlib's ``clientperavg``/``serverperavg`` (``tests/test_official_pfllib.py``).
    * Prompt length 1 at block 0 (SGPT spec 7.15) rather than the paper's full-model setting.
    """

    name = "per_fedavg"
    prompt_mode = "shallow"
    defaults = {"num_prompts": 1, "alpha": 0.01, "beta": None, "eval_steps": 1}
    param_rules = {"num_prompts": Int(1), "alpha": Number(0.0), "beta": Number(0.0, lo_open=True, optional=True),
                   "eval_steps": Int(0)}
    client_role = PerFedAvgClient
    evaluator_role = PerFedAvgEvaluator
