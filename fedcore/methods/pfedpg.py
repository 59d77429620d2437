"""pFedPG: a server-side prompt generator produces each client's visual prompts; clients adapt them locally."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from fedcore.constraints import Choice, Int, Number
from fedcore.backbones.prompted import init_prompts
from fedcore.engine.aggregation import normalized_weights
from fedcore.engine.batching import epochs_of_loss
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, Payload, RoundInfo, Strategy, Together, load_state
from fedcore.methods import register_method
from fedcore.methods.base import BatchableClient, PersonalEvaluator, PromptMethod, ce_losses, prompt_one_pass

PROMPT = "prompts.0"  # the VPT-shallow prompt tokens (num_prompts, D) that the generator produces
GENERATOR = ("descriptors", "keys", "basis")  # server_state tensors of the generator


def generate(server_state: dict[str, Any], cids: list[int] | Tensor) -> Tensor:
    """Generated prompts (len(cids), num_prompts, D): client descriptors attend over the prompt basis."""
    desc = server_state["descriptors"][torch.as_tensor(cids, dtype=torch.long, device=server_state["keys"].device)]
    keys, basis = server_state["keys"], server_state["basis"]
    attn = torch.softmax(desc @ keys.T / math.sqrt(keys.shape[1]), dim=-1)  # (n, L, K)
    return attn @ basis  # (n, L, D)


class PFedPGClient(BatchableClient):
    """Adapts its generated prompts and trains its own head with plain CE (so clients may train together)."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The adapted prompts go to the server (they drive the generator update)."""
        return [PROMPT]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """Heads stay local; with eval on adapted prompts, the client also keeps its last adapted prompts."""
        heads = [k for k in keys if k.startswith("head.")]
        return heads + ([PROMPT] if self.params["eval_prompts"] == "adapted" else [])

    def start(self, model: nn.Module, cid: int, state: Payload, downlink: Payload) -> None:
        """Its own head (and last prompts), then the freshly generated prompts on top."""
        load_state(model, state.get("model", {}))
        load_state(model, downlink["model"])

    def together(self, device: str, model: nn.Module) -> Together:
        """Clients train together at their epochs (``local_epochs`` or the experiment's); vmapped only at the
        experiment's (where its runs always did), in one pass at either."""
        epochs = self.params["local_epochs"]
        return epochs_of_loss(self, device, model, one_pass=prompt_one_pass(model, ce_losses), vmap=epochs is None,
                              epochs=epochs)

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], dict | None]:
        """The default CE epochs: ``local_epochs`` of them when set (FedHPL's setting: 5), else the experiment's."""
        epochs = self.params["local_epochs"]
        return super().train(model, cid, state, downlink, data,
                             settings if epochs is None else replace(settings, local_epochs=int(epochs)))


class PFedPGServer(Strategy):
    """The prompt generator: one downlink of generated prompts per client; one generator step per round."""

    def init_state(self, num_clients: int) -> Payload:
        """The generator for the run's M clients (drawn on the CPU so every device gets the same tensors)."""
        state = super().init_state(num_clients)
        dim = self.method.model.backbone.embed_dim
        n, k, h = self.params["num_prompts"], self.params["num_bases"], self.params["desc_dim"]
        device = self.method.model.head.weight.device
        state["descriptors"] = torch.randn(num_clients, n, h).to(device)
        state["keys"] = torch.randn(k, h).to(device)
        state["basis"] = init_prompts(k, dim, self.method.model.backbone.patch_size).detach().to(device)
        state["seen"] = torch.zeros(num_clients, dtype=torch.bool, device=device)
        return state

    def configure(self, state: Payload, cid: int) -> Payload:
        """Client ``cid``'s generated prompts."""
        with torch.no_grad():
            prompt = generate(state, [cid])[0]
        return {"model": {**state["model"], PROMPT: prompt}}

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """One SGD step of the generator along the clients' prompt updates; global = mean generated prompt."""
        state = dict(state)
        cids = [r.cid for r in results]
        # one full pFedHN step per client (weights sum to the number of clients), sample-size weighted
        w = torch.tensor(normalized_weights([float(r.num_samples) for r in results]),
                         device=state["basis"].device) * len(results)
        phi = {k: state[k].detach().clone().requires_grad_(True) for k in GENERATOR}
        with torch.enable_grad():
            generated = generate(phi, cids)                                   # (n, L, D)
            adapted = torch.stack([r.uplink["model"][PROMPT].to(generated) for r in results])
            signal = (generated - adapted).detach()                           # = -Delta_n: a descent direction
            surrogate = (w.view(-1, 1, 1) * generated * signal).sum()         # d/dphi = sum_n w_n J_n^T signal_n
            grads = torch.autograd.grad(surrogate, list(phi.values()))
        lr = float(self.params["gen_lr"])
        for k, g in zip(GENERATOR, grads, strict=True):
            state[k] = (phi[k] - lr * g).detach()
        state["seen"] = state["seen"].clone()
        state["seen"][torch.tensor(cids, device=state["seen"].device)] = True
        with torch.no_grad():
            everyone = generate(state, torch.arange(len(state["descriptors"])))
        state["model"] = {PROMPT: everyone.mean(dim=0).to(state["model"][PROMPT].dtype)}
        return state


class PFedPGEvaluator(PersonalEvaluator):
    """A trained client is scored with its last adapted prompts ("adapted"); otherwise with generated ones."""

    def load(self, model: nn.Module, cid: int | None, server: Payload, client_state: Payload | None,
             data: ClientData | None) -> None:
        """The client's last trained prompts + head ("adapted", once sampled), else its generated prompts + head."""
        if cid is not None and self.params["eval_prompts"] == "adapted" and bool(server["seen"][cid]):
            load_state(model, server["model"])
            load_state(model, (client_state or {}).get("model", {}))
            return
        super().load(model, cid, server, client_state, data)


@register_method
class PFedPG(PromptMethod):
    """pFedPG (Yang, Wang, Wang; ICCV 2023): client-specific prompt generation at the server.

    Algorithm, per round: the server generates client n's prompts P_n = G(d_n) from its learnable descriptor
    d_n (its downlink, ``configure``); client n trains the VPT-shallow prompts and its own linear head for the experiment's
    E epochs with the experiment's optimiser (plain cross-entropy, so the engine may batch clients) and uploads
    the adapted prompts P~_n; the server takes one SGD step on the generator with the chain-rule gradient
    sum_n w_n (dP_n/dphi)^T (P_n - P~_n), i.e. the local update Delta_n = P~_n - P_n is the descent direction
    for the generated prompts (pFedHN's first-order hypernetwork update, which pFedPG follows). This equals
    one SGD step on sum_n w_n * 0.5 ||G(d_n) - P~_n||^2 with P~_n held fixed. Heads are personal (the paper's
    "local classification head H_n" never leaves the client).

    Generator (the paper gives no sizes; our choice): phi = {descriptors d (M, L, h), keys K (num_bases, h),
    prompt basis B (num_bases, D)}; P_n = softmax(d_n K^T / sqrt(h)) B, i.e. each of client n's L prompt
    tokens is an attention-weighted mixture of a client-agnostic prompt basis, queried by the client's
    descriptor. d and K are N(0, 1) (different clients start from different mixtures), B has VPT's uniform
    init. Defaults num_bases = 8, desc_dim = 32; all generator tensors live in the server state (checkpointed).

    Generator learning rate ``gen_lr`` = 1.0 with plain SGD (no momentum), the natural scale of the
    regression step: with one-hot attention a client's generated prompt lands exactly on its adapted one;
    with soft attention a_n over the basis it moves a fraction a_n . a_n (~0.23 at init) of the way, plus
    the other clients' pulls w_m (a_n . a_m) (~0.13 each at init). A round's signals are summed, each a
    full pFedHN step (pFedHN updates after every client; the paper does not say how a round's clients are
    combined), weighted w_n = N_n / mean(N) over the round's clients; averaging them instead (a quarter of
    the step for 4 clients) left the generator far behind the adapted prompts on the tiny test task.

    Evaluation (``eval_prompts``): "adapted" (default) - a client that has trained uses the prompts and head
    it last trained (its personalised model); a never-sampled client uses its generated prompts with the
    initial head. "generated" - every client uses its current generated prompts with its own head.

    ``local_epochs`` (None: the experiment's E) sets the client's epochs per round; FedHPL's setting (spec §2: 10
    prompts, 5 local epochs, supervised pretrained ViT-B/16) is ``num_prompts: 10, local_epochs: 5``. Its Table 5
    counts: client side 10·768 prompts + a 768·n_c + n_c head (F2 − G2), uploads 7680 (7.5 K); its generator G2
    (1.512 M) has no published architecture, so ours (M·L·h + K·h + K·D, ~8 K at the defaults) cannot match it.

    Differences from the paper: prompt length 1 at block 0 only (SGPT spec 7.15 budget), whatever pFedPG's
    own prompt size; the generator architecture, sizes and lr above are ours (the paper's text was not at
    hand: only its overview - generator G, prompt basis P_base, client descriptors d_n, local heads H_n,
    Delta P = P~ - P as the server's signal); the experiment's optimiser, lr, E
    and participation are shared with the other baselines; the global state holds only the mean generated
    prompt over all clients (a summary; evaluation never uses it).
    """

    name = "pfedpg"
    prompt_mode = "shallow"
    defaults = {"num_prompts": 1, "num_bases": 8, "desc_dim": 32, "gen_lr": 1.0, "eval_prompts": "adapted",
                "local_epochs": None}
    param_rules = {"num_prompts": Int(1), "num_bases": Int(1), "desc_dim": Int(1), "gen_lr": Number(0.0),
                   "eval_prompts": Choice(("adapted", "generated")), "local_epochs": Int(1, optional=True)}
    client_role = PFedPGClient
    strategy_role = PFedPGServer
    evaluator_role = PFedPGEvaluator
