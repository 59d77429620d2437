"""FedHPL: heterogeneous FL with prompt tuning and logit distillation (Ma et al., arXiv:2405.17267).

Spec: spec/fedhpl.md §1 (method), §2 (hyper-parameters), §8 (defaults where the paper is silent).

Model (§1.1–1.3). Client k keeps its own frozen backbone (``client_backbones[k]``; ViTs and ResNets of
different widths may mix) and trains only prompts and a linear head, which never leave it. ViT: VPT-deep
(``prompt_depth: deep``, fresh tokens replace the previous block's prompt outputs at every block) or
VPT-shallow, ``num_prompts`` n = 3 tokens per block, VPT's uniform init; the head reads the final-norm CLS.
ResNet ("FedHPL (CNN)"): ``pad_width`` = 3 learnable pixels concatenated around the normalised image
(``PixelPadPrompt``), the frozen ResNet in eval mode, the head on its pooled feature.

Local update (§1.4, Alg. 1). Per batch: CE(p, y) + γ · mean_i KL(softmax(p̃_{k,y_i}/T) ‖ softmax(p_i/T)), with
the teacher p̃_{k,c} the server's client-specific logit of the sample's true class, T = 4.5, γ = 1, no T²
factor, mean over the whole batch (Alg. 1 divides the bracket by bs). A class that no client uploaded has no
teacher and its samples get CE only (C.4's "replace p̃ by the local logit" gives KL = 0); in round 1 no
class has one, so round 1 is CE only. The teacher reaches the loss as two buffers of the client's model
(``teacher``, ``teacher_mask``) loaded from the downlink, so that clients sharing one backbone can train
together (``Client.together``: one pass or one vmap over their stacked state) with each its own teacher.

Upload (§1.5). After local training, one pass over the client's own train set, no gradient, eval mode, no
augmentation. ``upload: All`` sends the raw logits with their labels of the samples it predicts correctly;
``upload: Average`` sends per class their mean and count (n_c·(n_c + 1) numbers). ``upload_correct_only:
false`` is Fig. 3(c)'s "upload all logits" (every sample, correct or not).

Server (§1.6, Eqs. 7, 8, 36). β_{k,j} = min(d_k/d_j, d_j/d_k), d the backbones' feature dims (``beta: dims``),
or β ≡ 1 (``beta: uniform``, Fig. 3(c)'s average aggregation). p̃_{k,c} = Σ_j β_{k,j} S_{j,c} / (1 + Σ_j β_{k,j}
|D̃_{j,c}|), with S_{j,c} the sum of client j's uploaded class-c logits and |D̃_{j,c}| their number (§8.1); the
"All" and "Average" uploads give the same sums. The server state holds these logits and the round's upload
counts only: no model tensor ever leaves a client (except with +P / +H, below). Every round the counts are
logged (Table 10: ``upload_count`` = |D̃_k| and ``upload_count_class<c>``; the engine logs ``upload_numbers``,
the numbers sent).

Evaluation (§3.3): each client's own model (``personalized``); with ``evaluation: {global_test:
official_test, per_class: true}`` every client is scored on the full test set, per client (mean, min, max
over clients) and per class.

+P / +H (§1.9, Table 3(e); ``share: prompts | head``, default ``none``). Besides its logits, each client uploads
its prompts (ViT prompt tokens or ResNet pad pixels) or its head. The server groups the uploaded tensors by
their shapes (same names and shapes: same backbone width, so hetvit gives {ViT-S: 0, 4}, {ViT-B: 1, 3}, {ViT-L:
2}, homo one group of all; grouped by shape, not by architecture name) and averages each group weighted by the
clients' sample counts (§8.18; a singleton group keeps its own tensors). At the start of its next round every
client of a group overwrites its copy with the group's average (``Client.start``); its evaluation at the end of
a round scores its model with that average in place (after the round's aggregation, as PFLlib scores
personalised methods). The logit distillation is unchanged.

Choices where the paper is silent (DEVIATIONS.md, FedHPL): the optimiser state persists across rounds
(``keep_optimizer``, §1.7; ViT clients still train together in one pass, each with its own optimiser state,
while ResNet clients then train one by one); the server uses the uploads of the round's clients only (the
paper has all 5 every round); pad pixels start at zero (``pad_init``); the upload pass reads every training
sample once, in index order (``ClientData.plain_batches``); logits travel in float32 and the server sums them
in float64.
+P / +H: a group's average goes to every client whose tensors have its shapes, also one that did not take
part in the round (FedAvg within the group), and a group none of whose clients took part keeps its previous
average; the kept optimiser state (momentum) is not averaged; ``upload_numbers`` counts every number sent,
the shared tensors included.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from fedcore.backbones.prompted import PromptedViT
from fedcore.backbones.resnet import PromptedResNet
from fedcore.constraints import Choice, Flag, Int, Number
from fedcore.engine.aggregation import weighted_average
from fedcore.engine.batching import epochs_of_loss
from fedcore.engine.optim import ClientData
from fedcore.engine.roles import (FitResult, Method, Payload, RoundContext, RoundInfo, State, Strategy, Together,
                                  load_state, module_state)
from fedcore.methods import register_method
from fedcore.methods.base import (TEACHER, TEACHER_MASK, DistillClient, PersonalEvaluator, PromptClassifier,
                                  per_class_sums, prompt_one_pass, with_teacher)

UPLOADS = ("All", "Average")
BETAS = ("dims", "uniform")
DEPTHS = ("deep", "shallow")
PAD_INITS = ("zeros", "normal")
SHARES = ("none", "prompts", "head")   # +P / +H (Table 3(e))
#: state-key prefixes of what ``share`` names: ViT prompt tokens or ResNet pad pixels, the linear head
SHARED_PREFIXES = {"none": (), "prompts": ("prompts.", "pad."), "head": ("head.",)}
SHARED = "shared"   # downlink and server-state key of the +P / +H group averages


# ---- the client's model -----------------------------------------------------------------------------
class PaddedResNetClassifier(nn.Module):
    """FedHPL (CNN): learnable pixels padded around the image, the frozen ResNet, a linear head."""

    def __init__(self, backbone: PromptedResNet, num_classes: int, width: int = 3, init: str = "zeros") -> None:
        super().__init__()
        self.backbone = backbone
        self.pad = backbone.make_pad_prompt(width=width, init=init)
        self.head = nn.Linear(backbone.feature_dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits."""
        return self.head(self.backbone(x, self.pad))


# ---- uploads and server algebra -----------------------------------------------------------------------
def upload_all(logits: Tensor, labels: Tensor) -> Payload:
    """The "All" uplink: every kept logit with its label."""
    return {"logits": logits.float(), "labels": labels.long()}


def upload_average(logits: Tensor, labels: Tensor, num_classes: int) -> Payload:
    """The "Average" uplink: per class the mean kept logit (zeros where none) and the count."""
    sums, counts = class_sums(upload_all(logits, labels), num_classes)
    means = torch.where(counts[:, None] > 0, sums / counts.clamp(min=1)[:, None], torch.zeros_like(sums))
    return {"means": means.float(), "counts": counts}


def class_sums(uplink: Payload, num_classes: int) -> tuple[Tensor, Tensor]:
    """(S (C, C), counts (C,)) in float64: per class the sum of the uplink's logits and their number."""
    if "means" in uplink:  # Eq. 36: the mean times the count is the sum
        counts = uplink["counts"].to(torch.float64)
        return uplink["means"].to(torch.float64) * counts[:, None], counts
    sums, counts = per_class_sums(uplink["logits"], uplink["labels"], num_classes)
    return sums, counts.to(torch.float64)


def beta_matrix(dims: Sequence[float]) -> Tensor:
    """Eq. 7: β_{k,j} = min(d_k/d_j, d_j/d_k) (K, K), float64; row k weighs the clients for client k."""
    d = torch.tensor([float(x) for x in dims], dtype=torch.float64)
    if (d <= 0).any():
        raise ValueError(f"latent dims must be positive, got {list(dims)}")
    ratio = d[:, None] / d[None, :]
    return torch.minimum(ratio, ratio.T)


def global_logits(sums: Tensor, counts: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 8 for every client k and class c: (p̃ (K, C, C), mask (K, C): 1 where some logit of c was uploaded).

    sums (J, C, C): client j's summed class-c logits; counts (J, C): their numbers; beta (K, J).
    p̃_{k,c} = Σ_j β_kj sums_jc / (1 + Σ_j β_kj counts_jc).
    """
    num = torch.einsum("kj,jcd->kcd", beta, sums)
    weight = beta @ counts
    return num / (1.0 + weight)[..., None], (weight > 0).to(sums.dtype)


def shape_signature(tensors: State) -> str:
    """The names and shapes of a set of tensors: clients with the same signature form one +P / +H group."""
    return "|".join(f"{k}:{'x'.join(map(str, t.shape))}" for k, t in sorted(tensors.items()))


def group_averages(results: Sequence[FitResult]) -> dict[str, State]:
    """Per shape signature, the sample-weighted average of the uplinks' ``model`` tensors (§8.18)."""
    groups: dict[str, list[FitResult]] = {}
    for r in results:
        groups.setdefault(shape_signature(r.uplink["model"]), []).append(r)
    return {sig: weighted_average([r.uplink["model"] for r in rs], [float(r.num_samples) for r in rs])
            for sig, rs in groups.items()}


# ---- roles --------------------------------------------------------------------------------------------
class FedHPLClient(DistillClient):
    """CE + logit distillation on prompts and head; uploads per-class knowledge (logits), and no tensor of its
    model unless ``share`` names one (+P: the prompts, +H: the head)."""

    def together(self, device: str, model: nn.Module) -> Together:
        """Clients sharing one backbone may train together (the default epochs of ``loss``, the teacher in buffers;
        see the module doc)."""
        return epochs_of_loss(self, device, model, one_pass=prompt_one_pass(model, self.client_losses))

    @property
    def keep_optimizer(self) -> bool:  # type: ignore[override]  # a param here, a class constant elsewhere
        """Whether each client's optimiser state persists across rounds (spec §1.7)."""
        return bool(self.params["keep_optimizer"])

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The prompts (+P) or the head (+H) besides the logits; nothing of the model by default."""
        prefixes = SHARED_PREFIXES[self.params["share"]]
        return [k for k in keys if k.startswith(prefixes)] if prefixes else []

    def start(self, model: nn.Module, cid: int, state: Payload, downlink: Payload) -> None:
        """The teacher, the client's own tensors, then (+P / +H) its group's average over its own copy."""
        super().start(model, cid, state, downlink)
        load_state(model, downlink.get(SHARED, {}))

    def upload(self, model: nn.Module, cid: int, data: ClientData, stats: dict[str, float]) -> Payload:
        """The correctly predicted logits (or all, for Fig. 3(c)), as "All" or "Average"; +P / +H: the model's
        prompts or head too."""
        logits, labels = self.local_logits(model, data)
        if self.params["upload_correct_only"]:
            keep = logits.argmax(dim=1) == labels
            logits, labels = logits[keep], labels[keep]
        if self.params["upload"] == "Average":
            up = upload_average(logits, labels, self.method.num_classes)
        else:
            up = upload_all(logits, labels)
        shared = self.shared_keys(self.method.keys(cid))
        return {**up, "model": module_state(model, shared)} if shared else up


class FedHPLServer(Strategy):
    """Weighted knowledge aggregation: client-specific per-class logits from every uploaded logit."""

    def init_state(self, num_clients: int) -> Payload:
        """No teacher yet (round 1 is CE only), no uploads; +P / +H: no group average yet."""
        c = self.method.num_classes
        state = {"logits": torch.zeros(num_clients, c, c), "mask": torch.zeros(num_clients, c),
                 "counts": torch.zeros(num_clients, c), "uploaded": torch.zeros(num_clients, dtype=torch.bool)}
        return {**state, SHARED: {}} if self.sharing else state

    @property
    def sharing(self) -> bool:
        """Whether clients also upload model tensors (+P / +H)."""
        return self.params["share"] != "none"

    def signature(self, cid: int) -> str:
        """Which +P / +H group client ``cid`` belongs to: the shapes of its shared tensors (from the recipe, so a
        client that did not take part in a round still finds its group)."""
        m = self.method
        return shape_signature(m.initial_state(cid, m.client.shared_keys(m.keys(cid))))

    def beta(self, num_clients: int) -> Tensor:
        """β (K, K) from each client's backbone feature dim, or all ones (``beta: uniform``)."""
        if self.params["beta"] == "uniform":
            return torch.ones(num_clients, num_clients, dtype=torch.float64)
        return beta_matrix([self.method.model_for(k).backbone.feature_dim for k in range(num_clients)])

    def configure(self, state: Payload, cid: int) -> Payload:
        """Client ``cid``'s teacher logits p̃_k (C, C) and which classes have one; +P / +H: its group's average
        (once there is one)."""
        down: Payload = {"model": {TEACHER: state["logits"][cid], TEACHER_MASK: state["mask"][cid]}}
        average = state[SHARED].get(self.signature(cid)) if self.sharing else None
        return {**down, SHARED: average} if average is not None else down

    def aggregate(self, info: RoundInfo, state: Payload, results: list[FitResult]) -> Payload:
        """Eq. 8 over the round's uploads; clients that did not take part contribute nothing."""
        k, c = state["logits"].shape[0], self.method.num_classes
        sums = torch.zeros(k, c, c, dtype=torch.float64)
        counts = torch.zeros(k, c, dtype=torch.float64)
        uploaded = torch.zeros(k, dtype=torch.bool)
        for r in results:
            s, n = class_sums(r.uplink, c)
            sums[r.cid], counts[r.cid], uploaded[r.cid] = s.cpu(), n.cpu(), True
        logits, mask = global_logits(sums, counts, self.beta(k))
        new = {"logits": logits.float(), "mask": mask.float(), "counts": counts.float(), "uploaded": uploaded}
        if self.sharing:   # groups without a client this round keep their previous average
            new[SHARED] = {**state[SHARED], **group_averages(results)}
        return new


class FedHPLEvaluator(PersonalEvaluator):
    """Each client's own model (+P / +H: with its group's average, the state its copy has after the round's
    aggregation, as PFLlib's personalised methods are scored); logs the round's upload counts (Table 10)."""

    def round_rows(self, ctx: RoundContext, model: nn.Module, server: Payload) -> list[tuple[int, str, str, float]]:
        """|D̃_k| and |D̃_{k,c}| per uploading client."""
        rows: list[tuple[int, str, str, float]] = []
        for k in torch.nonzero(server["uploaded"]).flatten().tolist():
            counts = server["counts"][k].tolist()
            rows.append((k, "train", "upload_count", float(sum(counts))))
            rows += [(k, "train", f"upload_count_class{c}", float(n)) for c, n in enumerate(counts)]
        return rows


@register_method
class FedHPL(Method):
    """Prompts + head on each client's frozen (possibly different) backbone; per-class logits distilled."""

    name = "fedhpl"
    defaults: dict[str, Any] = {
        "prompt_depth": "deep",         # ViT: deep (n tokens per block) | shallow (n tokens before block 0)
        "num_prompts": 3,               # n
        "pad_width": 3,                 # ResNet: learnable pixels on each side (Table 8)
        "pad_init": "zeros",            # ResNet pad pixels: zeros | normal (N(0, 0.02²))
        "temperature": 4.5,             # T
        "gamma": 1.0,                   # γ (0: Local)
        "upload": "All",                # All | Average (Tables 10, 11)
        "upload_correct_only": True,    # false: Fig. 3(c)'s "upload all logits"
        "beta": "dims",                 # dims (Eq. 7) | uniform (Fig. 3(c)'s average aggregation)
        "keep_optimizer": True,         # each client's optimiser state persists across rounds (§1.7)
        "share": "none",                # none | prompts (+P) | head (+H): also averaged per same-shape group
    }
    client_role = FedHPLClient
    strategy_role = FedHPLServer
    evaluator_role = FedHPLEvaluator

    param_rules = {
        "prompt_depth": Choice(DEPTHS),
        "num_prompts": Int(1),
        "pad_width": Int(1),
        "pad_init": Choice(PAD_INITS),
        "temperature": Number(0.0, lo_open=True),
        "gamma": Number(0.0),
        "upload": Choice(UPLOADS),
        "upload_correct_only": Flag(),
        "beta": Choice(BETAS),
        "keep_optimizer": Flag(),
        "share": Choice(SHARES),
    }

    def build(self, backbone: nn.Module) -> nn.Module:
        """VPT prompts + head on a ViT, pixel padding + head on a ResNet; plus the teacher buffers."""
        p, c = self.params, self.num_classes
        if isinstance(backbone, PromptedViT):
            model: nn.Module = PromptClassifier(backbone, c, p["prompt_depth"], int(p["num_prompts"]))
        elif isinstance(backbone, PromptedResNet):
            model = PaddedResNetClassifier(backbone, c, int(p["pad_width"]), p["pad_init"])
        else:
            raise TypeError(f"fedhpl needs a PromptedViT or PromptedResNet backbone, got {type(backbone).__name__}")
        return with_teacher(model, c)


__all__ = ["FedHPL", "PaddedResNetClassifier", "beta_matrix", "class_sums", "global_logits", "group_averages",
           "shape_signature", "upload_all", "upload_average"]
