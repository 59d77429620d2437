"""FedPFT (Wu, Niu, Liu, Shi, Zhu, Tang; arXiv 2407.16139, 2024): prompt-driven feature transformation.

Model (spec fedpft §1.1-§1.4; ``pft_modules.PFTModel``): the extractor φ (trained whole, BatchNorm statistics in
the state), τ = one self-attention layer over [φ(x), prompts] read at token 0, the classifier h_κ (m -> C), the
contrastive head h_ρ (m -> 128), and per client the prompts p_κ (n_κ = 10) and p_ρ (n_ρ = 20).
Shared (FedAvg by sample count, §1.8): φ with its BatchNorm buffers, τ, h_κ, h_ρ. Personal (never uploaded): p_κ,
p_ρ and the MoCo state: the key encoder (momentum copies of φ and h_ρ) and the queue, kept across rounds in the
client's state and in every checkpoint (§8 A3: ``key_encoder: persistent``; ``resync`` copies the global φ, h_ρ
at each round start). Evaluation: each client's personalised model, global φ, τ, h_κ + its own p_κ, on its own
test set (§1.10).

Local round (§1.7, Eqs. 5-6), a fresh optimiser for each phase (paper l.137: in the task phase "ϕi is updated
solely by L_CE", so no momentum of the feature phase's L_Con steps carries over; §8 A6 re-creates it every round;
``optimizer_scope: round``: one optimiser over both phases): R_f = ``feature_epochs`` epochs of the
feature-learning phase, then R_a = local_epochs − R_f of the task-adaptation phase; every step the sum L_CE + L_Con
(no weights, §1.5):
* feature phase trains p_κ, φ, τ, h_ρ (h_κ and p_ρ frozen); φ is run without gradient in the CE branch, so it
  learns from L_Con only;
* task phase trains φ, τ, h_κ, p_ρ (p_κ and h_ρ frozen); φ is run without gradient in the contrastive branch, so
  it learns from L_CE only; τ takes L_Con's gradient too (Eq. 6 literally, §8 A4; ``tau_con_grad_task: false``:
  only p_ρ learns from L_Con here).
L_CE reads the base view (the experiment's ``augment``, spec §2's per-dataset transform, the same for every method
of the experiment: §8 A5, A21; ``train_augment`` leaves it to the client, which applies it to this view only), L_Con two MoCo v1 views
(``moco_augment``) of the same batch (§1.5): q = norm(h_ρ(τ([φ(x'), p_ρ])_0)), k = norm(h̃_ρ(τ([φ̃(x''), p_ρ])_0))
with the same τ and p_ρ under no gradient; MoCo's order per step: momentum update of the key encoder, key, loss,
optimiser step, enqueue (in both phases, §8 A3).

Hyperparameters and their source: lr 0.1 for φ, h_κ, h_ρ and prompts (the experiment's optimizer; SGD momentum
0.9, no weight decay: §2 [R]), τ ``tau_lr`` 0.01 (0.05 ``tau_lr_no_con`` when the round has no L_Con: FedPFT w/o
L_Con, §2 [S]); n_κ 10, n_ρ 20, (R_f, R_a) = (3, 2) at Dirichlet α = 0.1 else (4, 1) (§2 [S]); MoCo: dim 128, K =
``queue_size`` 65536, m 0.999, β 0.07, linear head (MoCo v1 defaults, §1.5 [R]); τ: 8 heads, no residual, no norm
(§8 A1 [R]); prompts N(0, 0.02²) per client from the run seed (§8 A2 [R]; ``prompt_init: identical``).

Clients trained together (spec §7's compute note; ``client_batching``): :meth:`FedPFTClient.fit_together` runs a
round's clients in one vmapped pass per step (fedcore/engine/together.py's phases): the same phases, optimiser
(τ's lr as a per-tensor lr), routing and MoCo order; per client on the client axis: φ, τ, heads, prompts, BatchNorm
statistics, the key encoder (EMA in place under vmap, its own BatchNorm statistics) and the queue + pointer (the
enqueue as a function, :func:`pft_modules.enqueued`). Each client's views come from its own generator in the
order of the one-by-one loop (an epoch's shuffle, then per batch the base view's, query's and key's draws), then
one batched warp for all the group's images: the same random numbers, so the same client states up to float
reassociation (float64: 1e-9). ``auto`` (default): together only on a device where the batched round was measured
faster (``BATCHED_FASTER_ON``: none yet; on the CPU batching is about even at mini and slower at larger shapes,
benchmarks/bench_fedpft.py; on CUDA it is not measured yet), one by one elsewhere; ``batched`` / ``one_by_one`` force
one, and ``batched`` raises where it cannot run. τ runs in fp32 in both paths (autocast off: vmapped attention's
backward fails in bf16 on CUDA); the batched round's BatchNorms normalise in fp32 under autocast (the engine's rule).

Variants (§1.11, Table 3): ``contrastive: false`` (w/o L_Con = Setting III: no h_ρ, p_ρ, MoCo; the feature phase
trains p_κ and τ with L_CE); ``alternate: false`` (one joint phase of all epochs, every part trained by the summed
loss: Settings II, VII, VIII); ``n_rho: 0`` (the contrastive branch is τ([φ(x')]) without prompts: IV, VII);
``tau: false`` (no τ and no prompts: VI = FedAvg + MoCo, joint); ``classifier: personal`` (Fig. 2's
FedPFT_p_classifier: h_κ kept by each client); ``two_stage: T1`` (Fig. 5, §8 A19: rounds 1..T1 train only the
contrastive branch φ, τ, p_ρ, h_ρ; later rounds are FedPFT w/o L_Con from there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils._pytree import tree_map

from fedcore.constraints import Choice, Flag, Int, Number
from fedcore.engine.data import AUGMENTATIONS, PIXEL_AUGMENTATIONS
from fedcore.engine.optim import ClientData, TrainSettings, autocast_for, make_optimizer, only_training
from fedcore.engine.roles import (Client, FitResult, Method, Payload, RoundInfo, Strategy, Together, load_state,
                                  mean_stats, module_state)
from fedcore.engine.sampling import stream_seed
from fedcore.engine.together import Phase as StepKind, Trained, train_phases_together
from fedcore.methods import register_method
from fedcore.methods.base import INITS, PersonalEvaluator, random_weights, raw_backbone
from fedcore.methods.pft_modules import (KEY_PARTS, PFTModel, Views, enqueue, enqueued, fp32, momentum_update,
                                        moco_loss)

AUGMENT_NAMES = tuple(sorted(AUGMENTATIONS) + sorted(PIXEL_AUGMENTATIONS))


PROMPT_STREAM, QUEUE_STREAM = 0x9F7, 0x9F8  # stream_seed streams of a client's initial prompts and queue
PROMPTS = ("p_kappa", "p_rho")


@dataclass(frozen=True)
class Phase:
    """One phase of a local round: which parts train, which losses are on, and where φ and τ take gradients."""

    name: str
    train: tuple[str, ...]   # model parts: net, tau, head, con_head, p_kappa, p_rho
    ce: bool
    con: bool
    net_ce: bool = True      # φ takes L_CE's gradient
    net_con: bool = True     # φ takes L_Con's gradient
    tau_con: bool = True     # τ takes L_Con's gradient


ALL_PARTS = ("net", "tau", "head", "con_head", "p_kappa", "p_rho")


def phase_plan(params: dict[str, Any], local_epochs: int, stage: int = 0) -> list[tuple[Phase, int]]:
    """The round's phases and their epochs (stage 1/2: the two stages of ``two_stage``; 0: none)."""
    if stage == 1:
        return [(Phase("contrastive", ("net", "tau", "con_head", "p_rho"), ce=False, con=True), local_epochs)]
    con = bool(params["contrastive"]) and stage != 2
    if not params["alternate"]:
        return [(Phase("joint", ALL_PARTS, ce=True, con=con), local_epochs)]
    rf = int(params["feature_epochs"])
    if rf > local_epochs:
        raise ValueError(f"method_params: key 'feature_epochs' = {rf} exceeds the round's local_epochs = "
                         f"{local_epochs} (R_a = local_epochs - R_f)")
    if con:
        feature = Phase("feature", ("p_kappa", "net", "tau", "con_head"), ce=True, con=True, net_ce=False)
        task = Phase("task", ("net", "tau", "head", "p_rho"), ce=True, con=True, net_con=False,
                     tau_con=bool(params["tau_con_grad_task"]))
    else:
        feature = Phase("feature", ("p_kappa", "tau"), ce=True, con=False, net_ce=False)
        task = Phase("task", ("net", "tau", "head"), ce=True, con=False)
    return [(feature, rf), (task, local_epochs - rf)]


#: device types where FedPFT's batched round was measured faster than one by one (benchmarks/bench_fedpft.py): none
#: yet. CPU: 0.40-1.40x (slower at larger shapes); CUDA: not measured (scripts/gpu_check.sh measures it).
BATCHED_FASTER_ON: frozenset[str] = frozenset()


class Drawn(NamedTuple):
    """One step of a client trained together: its batch and the random draws of its views, made from the client's
    own generator when the step is pulled (the order of :meth:`FedPFTClient.losses`); applied batched later."""

    y: Tensor
    x: Tensor
    base: list[dict] | None    # one per ``base_augment`` name
    query: dict | None
    key: dict | None


class FedPFTClient(Client):
    """The alternating local round; uploads φ, τ, h_κ, h_ρ; keeps its prompts and MoCo state."""

    def train_augment(self, base: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The experiment's base augmentation goes to the CE view only (the client applies it); the MoCo views
        start from the un-augmented batch."""
        return tuple(self.augment), tuple(base)

    def together(self, device: str, model: nn.Module) -> Together:
        """``client_batching``: batched / one_by_one as asked; auto: together only on a device where the batched
        round was measured faster (``BATCHED_FASTER_ON``), one by one elsewhere. Its vmapped round runs on CUDA
        too: τ, its only attention, runs in fp32 (PFTModel.transform) and is one layer over 1 + n tokens."""
        mode = self.params["client_batching"]
        if mode == "one_by_one":
            return Together.no("method_params client_batching: one_by_one")
        if mode == "auto" and device not in BATCHED_FASTER_ON:
            return Together.no(f"client_batching: auto trains FedPFT's clients one by one on the {device.upper()}: "
                               "batching was not measured faster there (benchmarks/bench_fedpft.py)")
        return Together(self.fit_together, how="FedPFT's phases, one vmapped pass per step")

    def _personal(self, key: str) -> bool:
        return key in PROMPTS or (self.params["classifier"] == "personal" and key.startswith("head."))

    def shared_keys(self, keys: list[str]) -> list[str]:
        """φ (with BatchNorm buffers), τ, h_κ (unless personal), h_ρ."""
        return [k for k in keys if not self._personal(k)]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The prompts (and h_κ with ``classifier: personal``)."""
        return [k for k in keys if self._personal(k)]

    def init_state(self, cid: int) -> Payload:
        """Prompts N(0, std²) drawn for this client from the run seed; MoCo: the key encoder as the initial global
        φ and h_ρ, a queue of random unit keys (MoCo's init)."""
        m, p = self.method, self.params
        model = m.model_for(cid)
        device = next(model.parameters()).device
        state = dict(m.initial_state(cid, self.personal_keys(m.keys(cid))))
        who = 0 if p["prompt_init"] == "identical" else cid
        gen = torch.Generator().manual_seed(stream_seed(m.init_seed, 0, who, PROMPT_STREAM))
        for name in PROMPTS:
            if name in state:
                state[name] = (torch.randn(state[name].shape, generator=gen) * float(p["prompt_std"])).to(device)
        out: Payload = {"model": state}
        if model.key is not None:
            gen = torch.Generator().manual_seed(stream_seed(m.init_seed, 0, cid, QUEUE_STREAM))
            queue = F.normalize(torch.randn(int(p["con_dim"]), int(p["queue_size"]), generator=gen), dim=0)
            key = m.initial_state(cid, [k for k in m.keys(cid) if k.split(".")[0] in KEY_PARTS])
            out["moco"] = {"key": dict(key), "queue": queue.to(device), "ptr": 0}
        return out

    def fit(self, cid: int, state: Payload, downlink: Payload, data: ClientData,
            settings: TrainSettings) -> tuple[Payload, FitResult]:
        """Load the downlink and own state, the MoCo key encoder and queue; train the phases; keep the new MoCo state."""
        model = self.method.model_for(cid)
        self.start(model, cid, state, downlink)
        moco = None
        if model.key is not None:
            names = list(model.key.state_dict())
            source = downlink["model"] if self.params["key_encoder"] == "resync" else state["moco"]["key"]
            load_state(model.key, {k: source[k] for k in names})
            moco = {"queue": state["moco"]["queue"].clone(), "ptr": int(state["moco"]["ptr"])}
        stats = self.run_round(model, cid, int(downlink.get("stage", 0)), data, settings, moco)
        new_state, result = self.finish(model, cid, state, data, stats, None)
        if moco is not None:
            new_state["moco"] = {"key": module_state(model.key, list(model.key.state_dict())), **moco}
        return new_state, result

    def run_round(self, model: PFTModel, cid: int, stage: int, data: ClientData, settings: TrainSettings,
                  moco: dict | None) -> dict[str, float]:
        """Every phase of the round, a fresh optimiser per phase (``optimizer_scope: round``: one for the round; τ at
        its own lr); returns the mean losses per phase."""
        p = self.params
        plan = [(ph, e) for ph, e in phase_plan(p, settings.local_epochs, stage) if e > 0]
        named = dict(model.named_parameters())
        trainable = self.method.trainable_keys(cid)
        part = lambda k: k.split(".")[0]  # noqa: E731
        tau_lr = p["tau_lr"] if any(ph.con for ph, _ in plan) else p["tau_lr_no_con"]
        groups = [{"params": [named[k] for k in trainable if part(k) != "tau"]}]
        if model.tau is not None:
            groups.append({"params": [named[k] for k in trainable if part(k) == "tau"], "lr": float(tau_lr)})
        opt = make_optimizer(groups, settings.optimizer)
        sums: dict[str, Tensor] = {}
        counts: dict[str, int] = {}
        for i, (phase, epochs) in enumerate(plan):
            if i and p["optimizer_scope"] == "phase":
                opt = make_optimizer(groups, settings.optimizer)  # no momentum carried into the next phase
            with only_training(model, [k for k in trainable if part(k) in phase.train]):
                for _ in range(epochs):
                    for batch in data.batches():
                        opt.zero_grad(set_to_none=True)
                        with autocast_for(batch.x):
                            ce, con, key = self.losses(model, phase, batch, data, moco)
                        loss = sum(v for v in (ce, con) if v is not None)
                        loss.backward()
                        opt.step()
                        if key is not None:  # after the step: the loss read the queue before this batch's keys
                            moco["ptr"] = enqueue(moco["queue"], moco["ptr"], key)
                        n = len(batch.y)
                        for name, v in (("loss", loss), (f"ce_{phase.name}", ce), (f"con_{phase.name}", con),
                                        ("ce", ce), ("con", con)):
                            if v is not None:
                                sums[name] = sums.get(name, 0.0) + v.detach().double() * n
                                counts[name] = counts.get(name, 0) + n
        stats = {k: float(v) / counts[k] for k, v in sums.items()}
        return {"loss": stats.pop("loss", float("nan")), **stats}

    def fit_together(self, states: list[Payload], downlinks: list[Payload], datas: list[ClientData],
                     settings: TrainSettings) -> list[tuple[Payload, FitResult]]:
        """The round of every client in one vmapped pass per step (fedcore/engine/together.py's phases): the same
        phases, optimiser, views and MoCo updates as :meth:`fit`, client by client up to float reassociation."""
        m, p = self.method, self.params
        cid0 = datas[0].cid
        model = m.model_for(cid0).train()
        keys, trainable = m.keys(cid0), m.trainable_keys(cid0)
        stages = {int(down.get("stage", 0)) for down in downlinks}
        if len(stages) != 1:
            raise ValueError(f"FedPFT's clients trained together must share the round's stage, got {sorted(stages)}")
        plan = [(ph, e) for ph, e in phase_plan(p, settings.local_epochs, stages.pop()) if e > 0]
        missing = [d.cid for d in datas if d.pipeline is None and (d.base_augment or any(ph.con for ph, _ in plan))]
        if len({tuple(d.base_augment) for d in datas}) != 1:
            raise ValueError("FedPFT's clients trained together must share the experiment's base augmentation")
        if missing:
            raise ValueError(f"FedPFT's clients trained together make their views with ClientData.pipeline: None for "
                             f"clients {missing}")
        key_keys = list(model.key.state_dict()) if model.key is not None else []
        names = keys + ["key." + k for k in key_keys]
        starts, carries = [], []
        for st, down, d in zip(states, downlinks, datas, strict=True):
            self.start(model, d.cid, st, down)
            start = module_state(model, keys)
            if model.key is not None:
                source = down["model"] if p["key_encoder"] == "resync" else st["moco"]["key"]
                dev = st["moco"]["queue"].device  # the initial key encoder's new parts may still be on the CPU
                start.update({"key." + k: source[k].to(dev) for k in key_keys})
                carries.append({"queue": st["moco"]["queue"], "ptr": torch.tensor(int(st["moco"]["ptr"]), device=dev)})
            starts.append(start)
        part = lambda k: k.split(".")[0]  # noqa: E731
        kinds = {i: StepKind(tuple(k for k in trainable if part(k) in ph.train), self._together_loss(ph),
                             self._views_maker(datas[0].pipeline, tuple(datas[0].base_augment)))
                 for i, (ph, _) in enumerate(plan)}
        tau_lr = float(p["tau_lr"] if any(ph.con for ph, _ in plan) else p["tau_lr_no_con"])
        lrs = {k: tau_lr for k in trainable if part(k) == "tau"}
        mutable = [n for n, _ in model.named_parameters() if n.startswith("key.")]  # the EMA, in place
        streams = [self._drawn_steps(plan, d) for d in datas]
        with autocast_for(next(iter(model.parameters()))):
            finals = train_phases_together(model, names, kinds, starts, streams, settings.optimizer,
                                           carries=carries if model.key is not None else None, mutable=mutable,
                                           lrs=lrs, batch_len=lambda step: len(step.y),
                                           fresh_per_phase=p["optimizer_scope"] == "phase")
        return [self._finish_together(model, keys, key_keys, st, d, t)
                for st, d, t in zip(states, datas, finals, strict=True)]

    def _finish_together(self, model: PFTModel, keys: list[str], key_keys: list[str], state: Payload,
                         data: ClientData, t: Trained) -> tuple[Payload, FitResult]:
        """One client's new state and result from its row of the batched round (as :meth:`fit` ends)."""
        load_state(model, {k: t.state[k] for k in keys})
        stats = {"loss": t.logs.get("loss", float("nan")), **{k: v for k, v in t.logs.items() if k != "loss"}}
        new_state, result = self.finish(model, data.cid, state, data, stats, None)
        if model.key is not None:
            new_state["moco"] = {"key": {k: t.state["key." + k] for k in key_keys}, "queue": t.carry["queue"],
                                 "ptr": int(t.carry["ptr"])}
        return new_state, result

    def _drawn_steps(self, plan: list[tuple[Phase, int]], data: ClientData) -> Iterator[tuple[int, Drawn]]:
        """A client's steps over the round: (phase index, batch + its views' draws), drawn lazily in :meth:`fit`'s
        order (an epoch's shuffle, then per batch the base view's, the query's and the key's draws)."""
        p, pipe, gen = self.params, data.pipeline, data.generator
        for i, (phase, epochs) in enumerate(plan):
            for _ in range(epochs):
                for batch in data.batches():
                    shape = batch.x.shape
                    base = [pipe.draw(n, shape, gen) for n in data.base_augment] if phase.ce else None
                    query = key = None
                    if phase.con:
                        query, key = pipe.draw(p["moco_augment"], shape, gen), pipe.draw(p["moco_augment"], shape, gen)
                    yield i, Drawn(batch.y, batch.x, base, query, key)

    def _views_maker(self, pipe: Any, base_names: tuple[str, ...]) -> Any:
        """The batched views of a group's stacked steps (clients x batch): one augmentation call for all."""
        p = self.params

        def make(step: Drawn) -> Views:
            k, b = step.x.shape[:2]
            flat = lambda t: t.flatten(0, 1) if isinstance(t, Tensor) else t  # noqa: E731
            x = step.x.flatten(0, 1)
            base = query = key = None
            if step.base is not None:
                base = x
                for name, draws in zip(base_names, step.base, strict=True):
                    base = pipe.apply(base, name, tree_map(flat, draws))
            if step.query is not None:
                query = pipe.apply(x, p["moco_augment"], tree_map(flat, step.query))
                key = pipe.apply(x, p["moco_augment"], tree_map(flat, step.key))
            back = lambda t: None if t is None else t.view(k, b, *t.shape[1:])  # noqa: E731
            return Views(step.y, back(base), back(query), back(key))

        return make

    def _together_loss(self, phase: Phase) -> Any:
        """One client's step under vmap: the summed loss, its MoCo queue after the enqueue, the logged losses."""

        def loss(model: PFTModel, views: Views, carry: dict[str, Tensor]) -> tuple[Tensor, dict, dict]:
            ce, con, key = self.branch_losses(model, phase, views, carry.get("queue"), foreach=False)
            new_carry, logs = {}, {}
            if key is not None:
                new_carry["queue"], new_carry["ptr"] = enqueued(carry["queue"], carry["ptr"], key)
            for name, v in ((f"ce_{phase.name}", ce), (f"con_{phase.name}", con), ("ce", ce), ("con", con)):
                if v is not None:
                    logs[name] = v
            return sum(v for v in (ce, con) if v is not None), new_carry, logs

        return loss

    def losses(self, model: PFTModel, phase: Phase, batch, data: ClientData,
               moco: dict | None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(L_CE, L_Con, the batch's MoCo keys) of one step, each None where the phase has no such part."""
        p = self.params
        if data.augment is None and (data.base_augment or phase.con):
            raise ValueError("FedPFT makes its views with the run's augmentations: ClientData.augment is None")
        xw = x1 = x2 = None
        if phase.ce:
            xw = batch.x
            for name in data.base_augment:
                xw = data.augment(xw, name)
        if phase.con:
            x1, x2 = data.augment(batch.x, p["moco_augment"]), data.augment(batch.x, p["moco_augment"])
        return self.branch_losses(model, phase, Views(batch.y, xw, x1, x2), moco["queue"] if moco else None)

    def branch_losses(self, model: PFTModel, phase: Phase, views: "Views", queue: Tensor | None,
                      foreach: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """:meth:`losses` on views already made: nothing random (clients trained together run it under vmap,
        ``foreach`` False). Updates the key encoder (EMA) and the BatchNorm statistics in place."""
        p = self.params
        ce = con = key = None
        if phase.ce:
            with torch.set_grad_enabled(phase.net_ce):  # no graph through φ: BatchNorm still updates (§8 A22)
                f = model.net(views.base)
            ce = F.cross_entropy(fp32(model.head(model.transform(f, model.p_kappa))), views.y)
        if phase.con:
            with torch.set_grad_enabled(phase.net_con):
                f1 = model.net(views.query)
            q = F.normalize(fp32(model.con_head(model.transform(f1, model.p_rho, phase.tau_con))), dim=1)
            with torch.no_grad():
                momentum_update(model.key, model, float(p["moco_momentum"]), foreach)
                key = model.key_features(views.key)
            con = moco_loss(q, key, queue, float(p["temperature"]))
        return ce, con, key


class FedPFTStrategy(Strategy):
    """FedAvg of the shared parts; counts the rounds done so that ``two_stage`` can tell its clients the stage."""

    def init_state(self, num_clients: int) -> Payload:
        """The initial global model, no round done."""
        return {**super().init_state(num_clients), "rounds_done": 0}

    def configure(self, state: Payload, cid: int) -> Payload:
        """The global model (and, with ``two_stage``, the stage of the coming round)."""
        down = {"model": state["model"]}
        if self.params["two_stage"] is not None:
            down["stage"] = 1 if int(state.get("rounds_done", 0)) < int(self.params["two_stage"]) else 2
        return down

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """The sample-weighted average, and the round just done."""
        return {**super().aggregate(info, state, results), "rounds_done": info.round}

    def train_metrics(self, info: RoundInfo, results: list[FitResult]) -> dict[str, float]:
        """The per-phase L_CE / L_Con means over the round's clients (Fig. 5)."""
        return mean_stats(results)


@register_method
class FedPFT(Method):
    """FedPFT and its variants (see the module docstring)."""

    name = "fedpft"
    defaults = {"init": "pretrained", "n_kappa": 10, "n_rho": 20, "feature_epochs": 4, "tau_lr": 0.01,
                "tau_lr_no_con": 0.05, "contrastive": True, "alternate": True, "tau": True,
                "tau_con_grad_task": True, "heads": 8, "tau_residual": False, "tau_norm": False,
                "prompt_std": 0.02, "prompt_init": "per_client", "con_dim": 128, "queue_size": 65536,
                "moco_momentum": 0.999, "temperature": 0.07, "key_encoder": "persistent",
                "moco_augment": "moco_v1", "classifier": "global", "two_stage": None, "client_batching": "auto",
                "optimizer_scope": "phase"}
    param_rules = {"init": Choice(INITS), "n_kappa": Int(0), "n_rho": Int(0), "feature_epochs": Int(0),
                   "tau_lr": Number(0.0, lo_open=True), "tau_lr_no_con": Number(0.0, lo_open=True),
                   "contrastive": Flag(), "alternate": Flag(), "tau": Flag(), "tau_con_grad_task": Flag(),
                   "heads": Int(1), "tau_residual": Flag(), "tau_norm": Flag(), "prompt_std": Number(0.0),
                   "prompt_init": Choice(("per_client", "identical")), "con_dim": Int(1), "queue_size": Int(1),
                   "moco_momentum": Number(0.0, 1.0), "temperature": Number(0.0, lo_open=True),
                   "key_encoder": Choice(("persistent", "resync")), "classifier": Choice(("global", "personal")),
                   "two_stage": Int(1, optional=True),
                   "moco_augment": Choice(AUGMENT_NAMES),
                   "client_batching": Choice(("auto", "batched", "one_by_one")),
                   "optimizer_scope": Choice(("phase", "round"))}
    client_role = FedPFTClient
    strategy_role = FedPFTStrategy
    evaluator_role = PersonalEvaluator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the clients' prompt and queue draws come from the run's seeded generator (the engine seeds it first)
        self.init_seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """Combinations the rules cannot express."""
        if not params["tau"] and params["alternate"]:
            raise ValueError("key 'tau' = False needs 'alternate' = False: the feature phase trains p_κ against the "
                             "frozen classifier, and without τ there is no p_κ (Setting VI trains jointly)")
        if params["two_stage"] is not None and not (params["contrastive"] and params["alternate"] and params["tau"]):
            raise ValueError("key 'two_stage' needs contrastive, alternate and tau all true (stage 2 is FedPFT w/o "
                             "L_Con, stage 1 its contrastive branch)")

    @classmethod
    def check_federation(cls, params: dict[str, Any], federation: dict[str, Any]) -> None:
        """R_f must fit in the round's local epochs (R_a = local_epochs - R_f >= 0)."""
        if params["alternate"] and int(params["feature_epochs"]) > int(federation["local_epochs"]):
            raise ValueError(f"key 'feature_epochs' = {params['feature_epochs']}: allowed 0..{federation['local_epochs']}"
                             " (federation.local_epochs: R_a = local_epochs - R_f)")

    def build(self, backbone: nn.Module) -> nn.Module:
        """φ = the backbone's raw network (trained whole), and τ, the heads, the prompts and the MoCo key encoder."""
        p = self.params
        net = raw_backbone(backbone)
        if p["init"] == "random":
            random_weights(net)
        dim = int(backbone.feature_dim)
        if p["tau"] and dim % int(p["heads"]):
            raise ValueError(f"method_params.{self.name}: key 'heads' = {p['heads']} must divide the extractor's "
                             f"feature width {dim}")
        return PFTModel(net, dim, self.num_classes, use_tau=bool(p["tau"]), heads=int(p["heads"]),
                        residual=bool(p["tau_residual"]), norm=bool(p["tau_norm"]), n_kappa=int(p["n_kappa"]),
                        n_rho=int(p["n_rho"]), contrastive=bool(p["contrastive"]), con_dim=int(p["con_dim"]),
                        prompt_std=float(p["prompt_std"]))
