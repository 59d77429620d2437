"""The method interface: what a federated method may change, and sensible defaults for the rest.

Modelled on Flower's strategy: the engine owns sampling, the round loop, evaluation, seeding and
checkpoints; a method overrides only the steps where it differs:

* ``build``            - the trainable model around the frozen backbone;
* ``shared_names`` / ``personal_names`` - which trainable tensors go to the server and which stay
  with the client across rounds;
* ``init_server_state`` / ``setup`` - server-side state (momentum, counters, a generator) and any
  once-per-run exchange before round 1 (FedMix's mean data);
* ``start_state``      - the tensors a client starts its update from (default: global + its personal);
* ``local_update``     - the client's training in one round (losses, phases);
* ``upload``           - what the client sends (default: its shared tensors);
* ``aggregate``        - what the server does with the uploads (default: sample-weighted average);
* ``eval_state``       - a client's model at evaluation time (personalised methods; may adapt on data);
* ``predict``          - logits at evaluation time;
* ``round_rows``       - extra per-round metric rows a method logs for its paper's figures.

During a round the engine sets ``method.server_state`` to the server's state (clients only read it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

import torch
from torch import nn

from fedcore.backbones.prompted import PromptedViT, init_prompts
from fedcore.engine.aggregation import weighted_average

if TYPE_CHECKING:
    from fedcore.engine.data import DeviceSplit, InputPipeline
    from fedcore.engine.evaluate import EvalSets

Batches = Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class ClientData:
    """One client's training data as the engine hands it to ``local_update``."""

    cid: int
    num_samples: int
    batches: Batches  # a fresh, seeded pass over the client's data (one epoch) on each call
    generator: torch.Generator  # for any other randomness of this client in this round


@dataclass
class RoundContext:
    """What ``Method.round_rows`` may read: the round, the data and whether the round is evaluated."""

    round: int
    evaluated: bool
    train: "DeviceSplit"
    client_train: list[torch.Tensor]   # each client's train indices into ``train``
    eval_sets: "EvalSets"
    pipeline: "InputPipeline"
    batch_size: int                    # evaluation batch size


@dataclass
class TrainSettings:
    """The budget and optimiser of a local update (from the experiment's federation/optimizer)."""

    local_epochs: int
    batch_size: int
    optimizer: dict = field(default_factory=dict)


class PromptClassifier(nn.Module):
    """Frozen prompted ViT + optional shallow/deep prompts + a linear head on the CLS token."""

    def __init__(self, backbone: PromptedViT, num_classes: int, prompt_mode: str = "none",
                 num_prompts: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        dim, depth, patch = backbone.embed_dim, backbone.depth, backbone.patch_size
        self.prompt_mode = prompt_mode
        if prompt_mode == "none":
            self.prompts = nn.ParameterList()
        elif prompt_mode == "shallow":
            self.prompts = nn.ParameterList([init_prompts(num_prompts, dim, patch)])
        elif prompt_mode == "deep":
            self.prompts = nn.ParameterList([init_prompts(num_prompts, dim, patch) for _ in range(depth)])
        else:
            raise ValueError(f"prompt_mode must be none|shallow|deep, got {prompt_mode!r}")
        self.head = nn.Linear(dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """CLS feature after the final norm, with this model's prompts inserted."""
        prompts = {i: p for i, p in enumerate(self.prompts)}
        mode = "replace" if self.prompt_mode == "deep" else "insert"
        return self.backbone.forward_tokens(x, prompts, mode=mode)[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.head(self.features(x))

    def forward_owned(self, x: torch.Tensor, params: dict[str, torch.Tensor], owner: torch.Tensor) -> torch.Tensor:
        """Logits when sample i uses client owner[i]'s tensors; ``params`` stacks them on a leading client axis.

        This lets the engine train several clients' prompts and heads in one forward of the frozen backbone.
        """
        prompts = {i: params[f"prompts.{i}"][owner] for i in range(len(self.prompts))}  # (B, n, D) each
        mode = "replace" if self.prompt_mode == "deep" else "insert"
        feats = self.backbone.forward_tokens(x, prompts, mode=mode)[:, 0]
        logits = (params["head.weight"][owner] @ feats.unsqueeze(-1)).squeeze(-1)
        return logits + params["head.bias"][owner]


def autocast_for(x: torch.Tensor | tuple) -> torch.autocast:
    """bf16 autocast on CUDA (the frozen ViT dominates the cost), a no-op on CPU (keeps CPU runs bit-exact)."""
    t = x if isinstance(x, torch.Tensor) else x[0]  # a QueryBatch: (images, queries)
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=t.is_cuda)


def make_optimizer(params: list[nn.Parameter], cfg: dict) -> torch.optim.Optimizer:
    """The experiment's optimiser over ``params`` (fresh per client and round, as the papers' code does)."""
    name = cfg.get("name", "sgd")
    lr = cfg.get("lr", 0.01)
    wd = cfg.get("weight_decay", 0.0)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.get("momentum", 0.0), weight_decay=wd)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    raise ValueError(f"optimizer.name must be sgd|adam|adamw, got {name!r}")


class Method:
    """Base federated method: FedAvg over every trainable tensor of a head-only model."""

    name: ClassVar[str] = "base"
    #: evaluate each client's own model (shared + personal tensors) instead of one global model
    personalized: ClassVar[bool] = False
    #: train every client every round regardless of participation (Local)
    train_all_clients: ClassVar[bool] = False
    #: the engine may train a round's clients together (fedcore/engine/batched.py): only for methods whose
    #: local update is plain cross-entropy SGD on PromptClassifier tensors, with no other randomness
    batched_clients: ClassVar[bool] = False
    #: batches carry the dataset's cached frozen Select queries (rule select_features) as
    #: ``QueryBatch(images, queries)``; the method's ``params['select_block']`` names the block
    uses_select_queries: ClassVar[bool] = False
    #: default method parameters; the experiment's ``method_params[name]`` overrides them
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, backbone: PromptedViT, num_classes: int, params: dict | None = None) -> None:
        unknown = set(params or {}) - set(self.defaults)
        if unknown:
            raise ValueError(f"method_params.{self.name}: unknown key(s) {sorted(unknown)}; "
                             f"allowed: {sorted(self.defaults)}")
        self.params = {**self.defaults, **(params or {})}
        self.backbone = backbone
        self.num_classes = num_classes
        self.server_state: dict[str, Any] = {}  # set by the engine each round; read-only for clients
        self.model = self.build()

    # ---- what exists and who owns it ---------------------------------------------------------
    def build(self) -> nn.Module:
        """The model holding every trainable tensor (the frozen backbone is shared, not copied)."""
        return PromptClassifier(self.backbone, self.num_classes)

    def trainable_names(self) -> list[str]:
        """Names of the model's trainable tensors, in a fixed order."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def shared_names(self) -> list[str]:
        """Tensors sent to and aggregated by the server (default: all trainable)."""
        return self.trainable_names()

    def personal_names(self) -> list[str]:
        """Tensors each client keeps across rounds (default: none)."""
        return []

    def frozen_features(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A feature map that no trainable tensor affects, or None. When given, the engine computes it
        once per image and the method's ``loss``/``predict`` receive features instead of images."""
        return None

    # ---- state plumbing (engine uses these) --------------------------------------------------
    def get_state(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Detached copies of the named tensors."""
        params = dict(self.model.named_parameters())
        return {n: params[n].detach().clone() for n in names}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy tensors into the model in place."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, v in state.items():
                params[n].copy_(v)

    def init_server_state(self) -> dict[str, Any]:
        """Server-side state beyond the global tensors (momentum buffers, counters)."""
        return {}

    def setup(self, clients: list[ClientData], server_state: dict[str, Any]) -> None:
        """Once per run, before round 1, with every client's data (default: nothing to exchange)."""

    def start_state(self, cid: int, global_state: dict[str, torch.Tensor], personal_state: dict[str, torch.Tensor],
                    server_state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors client ``cid`` starts its local update from (default: global, then its personal ones)."""
        return {**global_state, **personal_state}

    def eval_state(self, cid: int, global_state: dict[str, torch.Tensor], personal_state: dict[str, torch.Tensor],
                   server_state: dict[str, Any], data: ClientData) -> dict[str, torch.Tensor]:
        """Client ``cid``'s model at evaluation (personalised methods only; ``data`` is its train data)."""
        return self.start_state(cid, global_state, personal_state, server_state)

    def round_rows(self, ctx: RoundContext) -> list[tuple[int, str, str, float]]:
        """Extra (client, split, metric, value) rows for this round, global state loaded (default: none)."""
        return []

    # ---- the round's steps -------------------------------------------------------------------
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Training loss of one batch."""
        return nn.functional.cross_entropy(self.model(x), y)

    def local_update(self, data: ClientData, settings: TrainSettings) -> dict[str, float]:
        """Train the trainable tensors for ``local_epochs`` epochs; return stats (mean loss)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return self.run_epochs(params, data, settings, settings.local_epochs, self.loss)

    def run_epochs(self, params: list[nn.Parameter], data: ClientData, settings: TrainSettings,
                   epochs: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Plain minibatch training of ``params`` with a fresh optimiser (a helper for overrides)."""
        opt = make_optimizer(params, settings.optimizer)
        total, count = None, 0  # the loss sum stays on the device: no GPU sync per step
        for _ in range(epochs):
            for x, y in data.batches():
                opt.zero_grad(set_to_none=True)
                with autocast_for(x):
                    loss = loss_fn(x, y)
                loss.backward()
                opt.step()
                step = loss.detach().double() * len(y)
                total = step if total is None else total + step
                count += len(y)
        return {"loss": float(total) / count if count else float("nan")}

    def upload(self, data: ClientData, stats: dict[str, float]) -> dict[str, Any]:
        """What the client sends to the server after its update."""
        return self.get_state(self.shared_names())

    def aggregate(self, global_state: dict[str, torch.Tensor], uploads: list[dict[str, Any]],
                  weights: list[float], server_state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """New global tensors from the uploads (default: sample-size-weighted average)."""
        return weighted_average(uploads, weights, names=list(global_state))

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Logits at evaluation time."""
        with autocast_for(x):
            return self.model(x).float()
