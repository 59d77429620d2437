"""pFedPG: a server-side prompt generator produces each client's visual prompts; clients adapt them locally."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from fedcore.backbones.prompted import PromptedViT, init_prompts
from fedcore.engine.aggregation import normalized_weights
from fedcore.methods.base import ClientData, Method, PromptClassifier

PROMPT = "prompts.0"  # the VPT-shallow prompt tokens (num_prompts, D) that the generator produces
GENERATOR = ("descriptors", "keys", "basis")  # server_state tensors of the generator


def generate(server_state: dict[str, Any], cids: list[int] | Tensor) -> Tensor:
    """Generated prompts (len(cids), num_prompts, D): client descriptors attend over the prompt basis."""
    desc = server_state["descriptors"][torch.as_tensor(cids, dtype=torch.long, device=server_state["keys"].device)]
    keys, basis = server_state["keys"], server_state["basis"]
    attn = torch.softmax(desc @ keys.T / math.sqrt(keys.shape[1]), dim=-1)  # (n, L, K)
    return attn @ basis  # (n, L, D)


class PFedPG(Method):
    """pFedPG (Yang, Wang, Wang; ICCV 2023): client-specific prompt generation at the server.

    Algorithm, per round: the server generates client n's prompts P_n = G(d_n) from its learnable descriptor
    d_n (``start_state``); client n trains the VPT-shallow prompts and its own linear head for the experiment's
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
    init. Defaults num_bases = 8, desc_dim = 32; all generator tensors live in ``server_state`` (checkpointed).

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

    Differences from the paper: prompt length 1 at block 0 only (SGPT spec 7.15 budget), whatever pFedPG's
    own prompt size; the generator architecture, sizes and lr above are ours (the paper's text was not at
    hand: only its overview - generator G, prompt basis P_base, client descriptors d_n, local heads H_n,
    Delta P = P~ - P as the server's signal); the experiment's optimiser, lr, E
    and participation are shared with the other baselines; the global state holds only the mean generated
    prompt over all clients (a summary; evaluation never uses it).
    """

    name = "pfedpg"
    personalized = True
    batched_clients = True  # the local update is plain cross-entropy on prompts + head, from per-client starts
    defaults = {"num_prompts": 1, "num_bases": 8, "desc_dim": 32, "gen_lr": 1.0, "eval_prompts": "adapted"}

    def __init__(self, backbone: PromptedViT, num_classes: int, params: dict | None = None) -> None:
        """Check ``eval_prompts`` on top of the base class's parameter checks."""
        super().__init__(backbone, num_classes, params)
        if self.params["eval_prompts"] not in ("adapted", "generated"):
            raise ValueError(f"method_params.pfedpg.eval_prompts must be adapted|generated, "
                             f"got {self.params['eval_prompts']!r}")

    def build(self) -> nn.Module:
        """VPT-shallow prompted classifier; its prompts are overwritten by the generator's each round."""
        return PromptClassifier(self.backbone, self.num_classes, "shallow", self.params["num_prompts"])

    def shared_names(self) -> list[str]:
        """The adapted prompts go to the server (they drive the generator update)."""
        return [PROMPT]

    def personal_names(self) -> list[str]:
        """Heads stay local; with eval on adapted prompts, the client also keeps its last adapted prompts."""
        heads = [n for n in self.trainable_names() if n.startswith("head.")]
        return heads + ([PROMPT] if self.params["eval_prompts"] == "adapted" else [])

    def setup(self, clients: list[ClientData], server_state: dict[str, Any]) -> None:
        """Create the generator for the run's M clients (drawn on the CPU so every device gets the same tensors)."""
        num_clients, dim = len(clients), self.backbone.embed_dim
        n, k, h = self.params["num_prompts"], self.params["num_bases"], self.params["desc_dim"]
        device = self.model.head.weight.device
        server_state["descriptors"] = torch.randn(num_clients, n, h).to(device)
        server_state["keys"] = torch.randn(k, h).to(device)
        server_state["basis"] = init_prompts(k, dim, self.backbone.patch_size).detach().to(device)
        server_state["seen"] = torch.zeros(num_clients, dtype=torch.bool, device=device)

    def start_state(self, cid: int, global_state: dict[str, Tensor], personal_state: dict[str, Tensor],
                    server_state: dict[str, Any]) -> dict[str, Tensor]:
        """Client ``cid`` starts from its generated prompts and its own head."""
        with torch.no_grad():
            prompt = generate(server_state, [cid])[0]
        return {**global_state, **personal_state, PROMPT: prompt}

    def eval_state(self, cid: int, global_state: dict[str, Tensor], personal_state: dict[str, Tensor],
                   server_state: dict[str, Any], data: ClientData) -> dict[str, Tensor]:
        """The client's last trained prompts + head ("adapted", once sampled), else its generated prompts + head."""
        if self.params["eval_prompts"] == "adapted" and bool(server_state["seen"][cid]):
            return {**global_state, **personal_state}
        return self.start_state(cid, global_state, personal_state, server_state)

    def upload(self, data: ClientData, stats: dict[str, float]) -> dict[str, Any]:
        """The adapted prompts and whose they are (the server regenerates the starting prompts itself)."""
        return {**self.get_state([PROMPT]), "cid": data.cid}

    def aggregate(self, global_state: dict[str, Tensor], uploads: list[dict[str, Any]], weights: list[float],
                  server_state: dict[str, Any]) -> dict[str, Tensor]:
        """One SGD step of the generator along the clients' prompt updates; global = mean generated prompt."""
        cids = [int(u["cid"]) for u in uploads]
        # one full pFedHN step per client (weights sum to the number of clients), sample-size weighted
        w = torch.tensor(normalized_weights(weights), device=server_state["basis"].device) * len(uploads)
        phi = {k: server_state[k].detach().clone().requires_grad_(True) for k in GENERATOR}
        with torch.enable_grad():
            generated = generate(phi, cids)                                   # (n, L, D)
            adapted = torch.stack([u[PROMPT].to(generated) for u in uploads])
            signal = (generated - adapted).detach()                           # = -Delta_n: a descent direction
            surrogate = (w.view(-1, 1, 1) * generated * signal).sum()         # d/dphi = sum_n w_n J_n^T signal_n
            grads = torch.autograd.grad(surrogate, list(phi.values()))
        lr = float(self.params["gen_lr"])
        for k, g in zip(GENERATOR, grads, strict=True):
            server_state[k] = (phi[k] - lr * g).detach()
        server_state["seen"] = server_state["seen"].clone()
        server_state["seen"][torch.tensor(cids, device=server_state["seen"].device)] = True
        with torch.no_grad():
            everyone = generate(server_state, torch.arange(len(server_state["descriptors"])))
        return {PROMPT: everyone.mean(dim=0).to(global_state[PROMPT].dtype)}
