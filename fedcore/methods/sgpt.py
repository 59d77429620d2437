"""SGPT: shared and group prompt tuning (Deng, Thrampoulidis, Li; CVPR 2024). Spec: spec/sgpt.md §1.

Model (§1.3). A frozen ViT; shared prompts P_S inserted right after CLS at the blocks in
``shared_blocks`` and kept (they accumulate; zero init); one group prompt per group at each block in
``group_blocks``, chosen per sample by ``Select`` (VPT uniform init); keys K (G, D), orthogonal init;
a linear head on the CLS token (Block I) or on mean(CLS, group-prompt tokens) when groups are active
(``pooling: cls_group``, the released code since its commit 199c38b of July 2024). ``pooling: cls_prompts`` is
the code of the paper's time: the mean of CLS and every shared-prompt token, plus the group-prompt tokens when
groups are active (config variant ``sgpt_code2024``, with no batch vote, the code's counter timing and
``query_relu``).

Select (§1.4). The query is the frozen, un-prompted ViT's final-norm CLS after ``select_block``, cached
per dataset by the ``features`` rule (artifact ``cls_block<b>``); Select compares cos(h, k_g) on the raw query
(Eq. 5/6); ``query_relu`` takes cos(ReLU(h), k_g) as the official code does (variant ``sgpt_code2024``).
Inference: argmax cos(q, k_g).
Training: argmin (1 - cos) * (q_g + 5e-4), q_g the global accumulated selection frequency (Eq. 6;
plain argmin while no counts exist); with ``batch_vote`` (feature shift, [code]) the whole batch takes
its most frequent group. The key loss -mean cos(q, k_g) reaches only the keys.

Local update (§1.5, Alg. 1 + code). ``schedule: bcd``: Block I trains {P_S, head} with CE for E epochs
(groups off), then Block II trains {P_G, K, head} with CE + key loss for E epochs, P_S inserted but
frozen; a fresh SGD optimiser per block, so a round is 2E passes as in the code. Each Block II forward
adds its selections to the client's counts N_g^i (each sample once per epoch).

Server (§1.6, Alg. 2). Head, P_S and P_G: average with N_i weights over the participating clients. Keys:
row g averaged with weights N_g^i / sum_i N_g^i (the paper's App. B, Alg. 2), uniform 1/m only where no client
chose g (the sum is 0); the official code also falls back when the sum is <= 50 (``key_fallback_count: 50``,
variant ``sgpt_code2024``). Momentum
(Eq. 7): k = a_k k_prev + (1 - a_k) k, P_G = a_g P_G,prev + (1 - a_g) P_G. The counter v_g adds the round's
counts once per round (Alg. 2; ``counter_update: per_round``); ``per_client`` adds each client's counts as
its result arrives, so later clients of a round already calibrate with them, as the official code does
(matched to 1.7e-6 per tensor against that code only with this timing; SGPT audit, issue 12 item 7).

Variants (Table 3, Table 4, Figs. 3, 4, 6) are parameter settings: ``schedule`` joint | bcd_inv, empty
``shared_blocks`` or ``group_blocks``, ``calibration: false``, ``key_aggregation: samples`` and the two
momentum ratios. ``trace_client``'s per-group selection counts under the current global Select are
logged every round (Fig. 3) and Select's clustering accuracy against coarse labels at evaluated rounds
(Table 4). Choices where paper and code are silent are listed in DEVIATIONS.md.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.prompted import PromptedViT, init_prompts
from fedcore.constraints import EMBED_DIM, LAST_CLIENT, BlockIndex, BlockList, Choice, Flag, Int, Number
from fedcore.engine.aggregation import add_counts, weighted_average
from fedcore.engine.batching import in_passes, one_pass_on, start_states
from fedcore.engine.data import Batch
from fedcore.engine.onepass import Owners, train_one_pass
from fedcore.engine.optim import ClientData, TrainSettings, autocast_for, epoch_stream, only_training, run_epochs
from fedcore.engine.roles import (Client, Evaluator, FitResult, Method, Payload, RoundContext, RoundInfo, Strategy,
                                  Together, load_state)
from fedcore.methods import register_method
from fedcore.metrics import hungarian_accuracy

QUERY = "select_query"  # the batch extra holding each sample's cached Select query

SCHEDULES = ("bcd", "bcd_inv", "joint")


def orthogonal_keys(groups: int, dim: int) -> Tensor:
    """Xavier-uniform keys made orthogonal by Gram-Schmidt: key 0 as drawn, later keys unit-norm [code]."""
    if groups > dim:
        raise ValueError(f"sgpt: {groups} orthogonal keys need groups <= embed dim {dim}")
    raw = nn.init.xavier_uniform_(torch.empty(groups, dim))
    out: list[Tensor] = [raw[0]]
    for i in range(1, groups):
        v = raw[i].clone()
        for u in out:
            v = v - (v @ u) / (u @ u) * u
        out.append(v / v.norm())
    return torch.stack(out)


POOLINGS = ("cls_group", "cls_prompts")


def select_scores(queries: Tensor, keys: Tensor, relu: bool = False) -> Tensor:
    """cos(q, k) for every (sample, group): (B, G), in float32; ``relu``: cos(ReLU(q), k) as the official code."""
    q = queries.float()
    # the paper's Eq. 5/6 take the raw CLS feature; the official code ReLUs it first (spec sgpt §1.4)
    q = F.normalize(F.relu(q) if relu else q, dim=-1)
    return q @ F.normalize(keys.float(), dim=-1).T


def select_groups(queries: Tensor, keys: Tensor, relu: bool = False) -> Tensor:
    """Inference-time Select (Eq. 5): the group of maximal cosine similarity for each query."""
    return select_scores(queries, keys, relu).argmax(dim=1)


class SGPTModel(nn.Module):
    """Shared prompts, group prompts, keys and head around a frozen PromptedViT."""

    def __init__(self, backbone: PromptedViT, num_classes: int, groups: int, shared_blocks: list[int],
                 group_blocks: list[int], first_shared_tokens: int, pooling: str = "cls_group") -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"sgpt pooling={pooling!r}: expected one of {POOLINGS}")
        self.pooling = pooling
        self.backbone = backbone
        dim = backbone.embed_dim
        for name, blocks in (("shared_blocks", shared_blocks), ("group_blocks", group_blocks)):
            bad = [b for b in blocks if not 0 <= b < backbone.depth]
            if bad or len(set(blocks)) != len(blocks):
                raise ValueError(f"sgpt {name}={blocks}: blocks must be distinct and in 0..{backbone.depth - 1}")
        self.shared_blocks, self.group_blocks = list(shared_blocks), list(group_blocks)
        self.shared = nn.ParameterList([nn.Parameter(torch.zeros(first_shared_tokens if i == 0 else 1, dim))
                                        for i in range(len(shared_blocks))])
        self.group = nn.ParameterList([init_prompts(groups, dim, backbone.patch_size) for _ in group_blocks])
        self.keys = nn.Parameter(orthogonal_keys(groups, dim))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor, groups: Tensor | None = None, owners: Owners | None = None) -> Tensor:
        """Logits; ``groups`` (B,) switches the group prompts on (None: Block I path, CLS feature); ``owners``: one
        pass (fedcore/engine/onepass.py), each sample with its own client's prompts, group tables and head."""
        prompts: dict[int, Tensor] = {b: p if owners is None else owners.expand(p)
                                      for b, p in zip(self.shared_blocks, self.shared)}
        if groups is not None:
            for b, table in zip(self.group_blocks, self.group):
                if owners is None:
                    g = table[groups].unsqueeze(1)  # (B, 1, D): one token per sample
                else:  # each segment's groups from its own client's table
                    g = torch.cat([t[gs] for t, gs in zip(owners.of(table), owners.split(groups))]).unsqueeze(1)
                s = prompts.get(b)
                if s is not None and owners is None:
                    s = s.unsqueeze(0).expand(len(g), -1, -1)
                # a block holding both: the group token goes first, as the code inserts it last
                prompts[b] = g if s is None else torch.cat([g, s], 1)
        tokens = self.backbone.forward_tokens(x, prompts, mode="insert")
        # token order after insertion: CLS, group tokens (deepest block first), shared tokens, patches
        grouped = len(self.group_blocks) if groups is not None else 0
        if self.pooling == "cls_prompts":  # the CVPR-era code: its count takes one token per shared block
            feat = tokens[:, : 1 + grouped + len(self.shared_blocks)].mean(dim=1)
        elif grouped:
            feat = tokens[:, : grouped + 1].mean(dim=1)  # mean(CLS, group tokens) [code]
        else:
            feat = tokens[:, 0]
        return self.head(feat) if owners is None else owners.linear(feat, self.head.weight, self.head.bias)


def assign(queries: Tensor, keys: Tensor, params: dict, freq: Tensor | None, train: bool) -> tuple[Tensor, Tensor]:
    """(groups (B,), key loss) for a batch of raw queries; calibrated (by ``freq``) and voted only in training."""
    with torch.autocast(queries.device.type, enabled=False):
        cos = select_scores(queries, keys, bool(params["query_relu"]))
        dist = 1.0 - cos.detach()
        if train and freq is not None:
            dist = dist * (freq.to(dist) + float(params["calibration_eps"]))
        groups = dist.argmin(dim=1)
        if train and params["batch_vote"]:
            # the vote's winner stays on the device (no read back: a sync per step on CUDA)
            votes = add_counts(groups.new_zeros(cos.shape[1]), groups)
            groups = votes.argmax().expand_as(groups).contiguous()
        key_loss = -cos.gather(1, groups[:, None]).mean()  # gradient reaches the keys only
    return groups, key_loss


class SGPTClient(Client):
    """Block coordinate descent over the schedule's phases; uploads its tensors and its selection counts."""

    def phases(self) -> list[tuple[list[str], bool, bool]]:
        """(trainable prefixes, groups on, key loss) per phase of the configured schedule."""
        p = self.params
        has_s, has_g = bool(p["shared_blocks"]), bool(p["group_blocks"])
        block1 = (["shared.", "head."], False, False)
        block2 = (["group.", "keys", "head."], True, True)
        if p["schedule"] == "joint":
            return [(["shared.", "group.", "keys", "head."], has_g, has_g)]
        if p["schedule"] == "bcd_inv":  # groups first; then shared with the groups inserted, frozen
            return ([block2] if has_g else []) + ([(["shared.", "head."], has_g, False)] if has_s else [])
        return ([block1] if has_s else []) + ([block2] if has_g else [])

    def fit(self, cid: int, state: Payload, downlink: Payload, data: ClientData,
            settings: TrainSettings) -> tuple[Payload, FitResult]:
        """Start, train the phases, finish; the uplink also carries the round's selection counts N_g^i."""
        model = self.method.model_for(cid)
        self.start(model, cid, state, downlink)
        stats, counts = self.train_phases(model, cid, downlink.get("v"), data, settings)
        new_state, result = self.finish(model, cid, state, data, stats, None)
        result.uplink["select_counts"] = counts
        return new_state, result

    def calibration(self, v: Tensor | None) -> Tensor | None:
        """The training-time selection frequencies q_g from the downlink's counter v (None: plain argmin)."""
        return (v / v.sum()) if self.params["calibration"] and v is not None and float(v.sum()) > 0 else None

    def train_phases(self, model: nn.Module, cid: int, v: Tensor | None, data: ClientData,
                     settings: TrainSettings) -> tuple[dict[str, float], Tensor]:
        """The schedule's phases, each E epochs with a fresh optimiser over only its tensors."""
        p = self.params
        counts = torch.zeros(int(p["groups"]), dtype=torch.float64, device=model.keys.device)
        freq = self.calibration(v)
        trainable = self.method.trainable_keys(cid)
        stats: dict[str, float] = {}
        for prefixes, groups_on, key_loss_on in self.phases():
            keys = [k for k in trainable if any(k.startswith(x) for x in prefixes)]

            def loss_fn(batch: Batch, groups_on=groups_on, key_loss_on=key_loss_on) -> Tensor:
                if not groups_on:
                    return F.cross_entropy(model(batch.x, None).float(), batch.y)
                groups, key_loss = assign(batch.extras[QUERY], model.keys, p, freq, train=True)
                if key_loss_on:  # N_g^i counts the selections of the phases that train the keys
                    add_counts(counts, groups)
                loss = F.cross_entropy(model(batch.x, groups).float(), batch.y)
                return loss + float(p["key_loss_weight"]) * key_loss if key_loss_on else loss

            with only_training(model, keys) as params:  # frozen tensors get no gradient: the backward stops earlier
                stats = run_epochs(params, data, settings, settings.local_epochs, loss_fn)[0]
        return stats, counts.clone()

    def together(self, device: str, model: nn.Module) -> Together:
        """A round's clients in one pass (:meth:`fit_together`), unless the counter changes between them."""
        if self.params["counter_update"] == "per_client":
            return Together.no("counter_update: per_client: each client calibrates with the counts of the clients "
                               "before it in the round")
        if not one_pass_on(device):
            return Together.no(f"SGPT trains together in one pass only, not taken on the {device.upper()}")
        return Together(in_passes(self.fit_together), how="one pass through the frozen backbone per step of each block",
                        exact=device == "cpu")

    def fit_together(self, states: list[Payload], downlinks: list[Payload], datas: list[ClientData],
                     settings: TrainSettings) -> list[tuple[Payload, FitResult]]:
        """The round's clients in one pass per step (fedcore/engine/onepass.py), block after block as :meth:`fit`:
        each client's batches, Select (with its own keys and calibration), counts, optimisers and stats as there."""
        m, p = self.method, self.params
        model = m.model_for(datas[0].cid).train()
        keys, trainable = m.keys(datas[0].cid), m.trainable_keys(datas[0].cid)
        current = start_states(self, model, keys, states, downlinks, datas)
        freqs = [self.calibration(down.get("v")) for down in downlinks]
        counts = torch.zeros(len(datas), int(p["groups"]), dtype=torch.float64, device=model.keys.device)
        losses: list[float] = [float("nan")] * len(datas)
        for prefixes, groups_on, key_loss_on in self.phases():
            phase = [k for k in trainable if any(k.startswith(x) for x in prefixes)]
            fn = self._client_losses(groups_on, key_loss_on, freqs, counts)
            streams = [epoch_stream(d, settings.local_epochs) for d in datas]
            fitted = train_one_pass(model, keys, phase, current, streams, fn, settings.optimizer,
                                    compile_mode=settings.compile)
            current, losses = [f.state for f in fitted], [f.loss for f in fitted]
        out = []
        for st, d, final, loss, n in zip(states, datas, current, losses, counts, strict=True):
            load_state(model, final)
            new_state, result = self.finish(model, d.cid, st, d, {"loss": loss}, None)
            result.uplink["select_counts"] = n.clone()
            out.append((new_state, result))
        return out

    def _client_losses(self, groups_on: bool, key_loss_on: bool, freqs: list[Tensor | None],
                       counts: Tensor) -> Any:
        """One block's loss of each client on its segment (one pass): Select with the client's own keys and
        calibration, its counts N_g^i, CE (+ the key loss)."""
        p = self.params

        def losses(model: nn.Module, batch: Batch, owners: Owners) -> Tensor:
            if not groups_on:
                return owners.per_client(F.cross_entropy, model(batch.x, None, owners).float(), batch.y)
            picks = [assign(q, k, p, freqs[r], train=True)
                     for q, k, r in zip(owners.split(batch.extras[QUERY]), owners.of(model.keys), owners.rows)]
            if key_loss_on:  # N_g^i counts the selections of the phases that train the keys
                for r, (groups, _) in zip(owners.rows, picks):
                    add_counts(counts[r], groups)
            logits = model(batch.x, torch.cat([g for g, _ in picks]), owners).float()
            ce = owners.per_client(F.cross_entropy, logits, batch.y)
            if not key_loss_on:
                return ce
            return ce + float(p["key_loss_weight"]) * torch.stack([key for _, key in picks])

        return losses


class SGPTServer(Strategy):
    """N_i-weighted head/prompts, count-weighted keys, momentum on keys and group prompts, counter v."""

    def init_state(self, num_clients: int) -> Payload:
        """The global model and the accumulated selection counter v_g (Alg. 2 line 14)."""
        return {**super().init_state(num_clients), "v": torch.zeros(int(self.params["groups"]), dtype=torch.float64)}

    def configure(self, state: Payload, cid: int) -> Payload:
        """The global model and v_g (for the training-time calibration q_g)."""
        return {"model": state["model"], "v": state["v"]}

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """Alg. 2: averages, count-weighted keys, momentum, then v += the round's counts."""
        p = self.params
        glob = state["model"]
        uploads = [r.uplink["model"] for r in results]
        weights = [float(r.num_samples) for r in results]
        names = [n for n in glob if n != "keys"]
        new = weighted_average(uploads, weights, names=names)
        counts = torch.stack([r.uplink["select_counts"].to(torch.float64) for r in results])  # (m, G)
        total = counts.sum(dim=0)
        new["keys"] = aggregate_keys([u["keys"] for u in uploads], counts, weights, p["key_aggregation"],
                                     float(p["key_fallback_count"]))
        a_k, a_g = float(p["key_momentum"]), float(p["group_momentum"])
        new["keys"] = a_k * glob["keys"] + (1.0 - a_k) * new["keys"]
        for n in names:
            if n.startswith("group."):
                new[n] = a_g * glob[n] + (1.0 - a_g) * new[n]
        if p["counter_update"] == "per_client":  # already added, client by client (observe)
            return {**state, "model": new}
        return {**state, "model": new, "v": state["v"].to(total) + total}

    def observe(self, info: RoundInfo, state: Payload, result: FitResult) -> Payload:
        """``counter_update: per_client`` (the official code's timing): v_g += this client's counts now."""
        if self.params["counter_update"] != "per_client":
            return state
        counts = result.uplink["select_counts"].to(torch.float64)
        return {**state, "v": state["v"].to(counts) + counts}


class SGPTEvaluator(Evaluator):
    """One global model; inference selects groups by plain argmax (Alg. 3); logs Select's statistics."""

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> Tensor:
        """Logits with plain argmax selection, no calibration, no local fine-tuning."""
        groups = assign(batch.extras[QUERY], model.keys, self.params, None, train=False)[0] \
            if self.params["group_blocks"] else None
        with autocast_for(batch.x):
            return model(batch.x, groups).float()

    @torch.no_grad()
    def round_rows(self, ctx: RoundContext, model: nn.Module, server: Payload) -> list[tuple[int, str, str, float]]:
        """Trace client's per-group selection counts (Fig. 3); Select's clustering accuracy (Table 4)."""
        if not self.params["group_blocks"]:
            return []
        rows: list[tuple[int, str, str, float]] = []
        c = int(self.params["trace_client"])
        queries = ctx.train.extras.get(QUERY)
        if 0 <= c < len(ctx.client_train) and queries is not None:
            groups = select_groups(queries[ctx.client_train[c]], model.keys, bool(self.params["query_relu"]))
            counts = torch.bincount(groups, minlength=int(self.params["groups"])).tolist()
            rows += [(c, "train", f"select_g{g:02d}", float(n)) for g, n in enumerate(counts)]
        # Table 4 scores Select on the whole test split (paper §5.3.1: "the CIFAR-100 test dataset"), not only the
        # union of the clients' local test sets (~95 % of it at s=10, ~75 % at s=50)
        src = ctx.eval_sets.official if ctx.eval_sets.official is not None else ctx.eval_sets.source
        if ctx.evaluated and src.coarse is not None and QUERY in src.extras:
            pred = select_groups(src.extras[QUERY], model.keys, bool(self.params["query_relu"])).cpu().numpy()
            acc = hungarian_accuracy(pred, src.coarse.cpu().numpy())
            rows.append((-1, "global", "select_cluster_acc", acc))
        return rows


@register_method
class SGPT(Method):
    """Shared + group prompts with Select, block coordinate descent and momentum aggregation."""

    name = "sgpt"
    defaults = {
        "groups": 20,                    # G
        "shared_blocks": [0, 1, 2, 3],   # U_S, 0-indexed (CIFAR-100 s=10, spec §1.3)
        "group_blocks": [4, 5, 6],       # U_G
        "select_block": 11,              # the block whose final-norm CLS is the Select query
        "query_relu": False,             # cos(ReLU(h), k) as the official code; the paper (Eq. 5/6): cos(h, k)
        "first_shared_tokens": 1,        # n_prompt at the first shared block (prompt length 1)
        "key_momentum": 0.5,             # alpha_k
        "group_momentum": 0.5,           # alpha_g
        "calibration": True,             # q_g frequency calibration of training-time selection
        "calibration_eps": 5.0e-4,       # [code]
        "key_aggregation": "counts",     # counts (Alg. 2) | samples (plain FedAvg weights, Table 4)
        "key_fallback_count": 0,         # uniform key weights when a group's round count is <= this ([code]: 50)
        "key_loss_weight": 1.0,          # [code]
        "batch_vote": False,             # feature shift: the batch's most frequent group for all [code]
        "schedule": "bcd",               # bcd | bcd_inv | joint (Table 3)
        "trace_client": 0,               # whose selection counts are logged every round (Fig. 3)
        "counter_update": "per_round",   # per_round (Alg. 2) | per_client (the official code's timing)
        "pooling": "cls_group",          # cls_group (code since 199c38b) | cls_prompts (the code of the paper's time)
    }
    param_rules = {
        "groups": Int(1, EMBED_DIM),     # G orthogonal keys fit in the embed dim
        "shared_blocks": BlockList(),
        "group_blocks": BlockList(),
        "select_block": BlockIndex(),
        "query_relu": Flag(),
        "first_shared_tokens": Int(1),
        "key_momentum": Number(0.0, 1.0),
        "group_momentum": Number(0.0, 1.0),
        "calibration": Flag(),
        "calibration_eps": Number(0.0),
        "key_aggregation": Choice(("counts", "samples")),
        "key_fallback_count": Number(0.0),
        "key_loss_weight": Number(0.0),
        "batch_vote": Flag(),
        "schedule": Choice(SCHEDULES),
        "trace_client": Int(0, LAST_CLIENT),
        "counter_update": Choice(("per_round", "per_client")),
        "pooling": Choice(POOLINGS),
    }
    client_role = SGPTClient
    strategy_role = SGPTServer
    evaluator_role = SGPTEvaluator

    @classmethod
    def artifacts(cls, params: dict) -> dict[str, str]:
        """Each sample's Select query: the frozen final-norm CLS after ``select_block`` (rule ``features``)."""
        return {QUERY: f"cls_block{int(cls.with_defaults(params)['select_block'])}"}

    @classmethod
    def check_params(cls, params: dict) -> None:
        """At least one prompt set (each param's own range is in ``param_rules``)."""
        if not params["shared_blocks"] and not params["group_blocks"]:
            raise ValueError("method_params.sgpt: shared_blocks and group_blocks cannot both be empty")

    def build(self, backbone: PromptedViT) -> nn.Module:
        """SGPTModel with the configured block sets."""
        p = self.params
        return SGPTModel(backbone, self.num_classes, int(p["groups"]), list(p["shared_blocks"]),
                         list(p["group_blocks"]), int(p["first_shared_tokens"]), str(p["pooling"]))


def aggregate_keys(keys: list[Tensor], counts: Tensor, weights: list[float], rule: str,
                   fallback: float) -> Tensor:
    """Row-wise key average: N_g^i / sum_i N_g^i (uniform 1/m if the sum <= fallback), or N_i weights."""
    stacked = torch.stack([k.to(torch.float64) for k in keys])  # (m, G, D)
    m = len(keys)
    if rule == "samples":
        w = torch.tensor(weights, dtype=torch.float64)
        w = (w / w.sum())[:, None].expand(m, counts.shape[1])
    else:
        total = counts.sum(dim=0)
        w = torch.where(total > fallback, counts / total.clamp(min=1.0), torch.full_like(counts, 1.0 / m))
    return (w.to(stacked.device)[:, :, None] * stacked).sum(dim=0).to(keys[0].dtype)


__all__ = ["SGPT", "SGPTModel", "aggregate_keys", "assign", "orthogonal_keys", "select_groups", "select_scores"]
