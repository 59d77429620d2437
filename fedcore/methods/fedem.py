"""FedEM (Marfoq et al., NeurIPS 2021): a mixture of shared prompt+head components, personal mixture weights
learned by EM on each client; each component averaged by FedAvg."""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Int
from fedcore.backbones.prompted import PromptedViT, init_prompts
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings, autocast_for, run_epochs
from fedcore.engine.roles import Client, Method, Payload
from fedcore.methods import register_method
from fedcore.methods.base import PersonalEvaluator


class StackedLinear(nn.Module):
    """M independent linear heads D -> C stored as one (M, C, D) weight and (M, C) bias."""

    def __init__(self, components: int, dim: int, num_classes: int) -> None:
        super().__init__()
        heads = [nn.Linear(dim, num_classes) for _ in range(components)]  # PyTorch's init, drawn per head
        self.weight = nn.Parameter(torch.stack([h.weight.detach() for h in heads]))
        self.bias = nn.Parameter(torch.stack([h.bias.detach() for h in heads]))


class MixturePromptClassifier(nn.Module):
    """M VPT-shallow components (prompt tokens + linear head each) on one shared frozen ViT, plus mixture
    weights ``pi`` (a buffer: FedEM's E/M steps set it, no gradient does)."""

    def __init__(self, backbone: PromptedViT, num_classes: int, components: int, num_prompts: int) -> None:
        super().__init__()
        if components < 1:
            raise ValueError(f"components must be >= 1, got {components}")
        self.backbone = backbone
        dim, patch = backbone.embed_dim, backbone.patch_size
        self.components = components
        # independent random inits break the symmetry between components (identical ones would stay identical)
        self.prompts = nn.Parameter(torch.stack([init_prompts(num_prompts, dim, patch).detach()
                                                 for _ in range(components)]))  # (M, n, D)
        self.head = StackedLinear(components, dim, num_classes)
        self.register_buffer("pi", torch.full((components,), 1.0 / components))  # set by EM, not by gradient

    def component_logits(self, x: Tensor, prompts: Tensor | None = None, weight: Tensor | None = None,
                         bias: Tensor | None = None) -> Tensor:
        """Logits (M, B, C) of every component, in one backbone pass over M copies of the batch.

        ``prompts``/``weight``/``bias`` default to the module's tensors (others: a frozen snapshot).
        """
        prompts = self.prompts if prompts is None else prompts
        weight = self.head.weight if weight is None else weight
        bias = self.head.bias if bias is None else bias
        m, b = prompts.shape[0], x.shape[0]
        owner = torch.arange(m, device=x.device).repeat_interleave(b)  # copy k of the batch uses component k
        xx = x.unsqueeze(0).expand(m, *x.shape).reshape(m * b, *x.shape[1:])
        feats = self.backbone.forward_tokens(xx, {0: prompts[owner]}, mode="insert")[:, 0].view(m, b, -1)
        return torch.baddbmm(bias.unsqueeze(1).to(feats.dtype), feats, weight.transpose(1, 2).to(feats.dtype))

    def forward(self, x: Tensor) -> Tensor:
        """Mixture log-probabilities log sum_m pi_m softmax(f_m(x)) (B, C)."""
        return mixture_log_probs(self.component_logits(x).float(), self.pi)


def mixture_log_probs(logits: Tensor, pi: Tensor) -> Tensor:
    """log sum_m pi_m softmax(logits_m) for logits (M, B, C) and weights pi (M,)."""
    log_pi = pi.to(logits.dtype).clamp_min(torch.finfo(logits.dtype).tiny).log()
    return torch.logsumexp(F.log_softmax(logits, dim=-1) + log_pi.view(-1, 1, 1), dim=0)


def responsibilities(losses: Tensor, pi: Tensor) -> Tensor:
    """E-step posteriors q(m | x_i, y_i) proportional to pi_m exp(-loss_m,i); ``losses`` (M, B) -> q (M, B)."""
    log_pi = pi.to(losses.dtype).clamp_min(torch.finfo(losses.dtype).tiny).log()
    return torch.softmax(log_pi.unsqueeze(1) - losses, dim=0)


def component_losses(model: nn.Module, x: Tensor, y: Tensor, params: tuple[Tensor, ...] = ()) -> Tensor:
    """Per-sample cross-entropy (M, B) of every component (``params``: a snapshot, else the live tensors)."""
    with autocast_for(x):
        logits = model.component_logits(x, *params)
    m, b = logits.shape[:2]
    return F.cross_entropy(logits.float().reshape(m * b, -1), y.repeat(m), reduction="none").view(m, b)


class FedEMClient(Client):
    """One E-step (responsibilities, then pi), then E epochs of the responsibility-weighted M-step."""

    def shared_keys(self, keys: list[str]) -> list[str]:
        """The stacked components go to the server."""
        return [k for k in keys if k != "pi"]

    def personal_keys(self, keys: list[str]) -> list[str]:
        """The mixture weights stay with their client."""
        return ["pi"]

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], None]:
        """E-step over the client's data with the start-of-round tensors, then the weighted M-step."""
        snapshot = (model.prompts.detach().clone(), model.head.weight.detach().clone(),
                    model.head.bias.detach().clone())
        pi_old = model.pi.detach().clone()
        with torch.no_grad():
            q_sum, n = None, 0
            for b in data.batches():
                q = responsibilities(component_losses(model, b.x, b.y, snapshot), pi_old).sum(dim=1)
                q_sum, n = (q if q_sum is None else q_sum + q), n + len(b.y)
            if n:
                model.pi.copy_((q_sum / n).to(model.pi.dtype))

        def m_step_loss(b: Batch) -> Tensor:
            with torch.no_grad():  # the same q as the E-step: same snapshot, same old pi
                q = responsibilities(component_losses(model, b.x, b.y, snapshot), pi_old)
            return (q * component_losses(model, b.x, b.y)).sum() / len(b.y)

        params = [model.prompts, model.head.weight, model.head.bias]
        return run_epochs(params, data, settings, settings.local_epochs, m_step_loss)[0], None


class FedEMEvaluator(PersonalEvaluator):
    """Each client's mixture: the global components with its own pi."""

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> Tensor:
        """Personalised log-probabilities log Σ_m π_m softmax(f_m(x)) (argmax = the mixture's prediction)."""
        with autocast_for(batch.x):
            logits = model.component_logits(batch.x)
        return mixture_log_probs(logits.float(), model.pi)


@register_method
class FedEM(Method):
    """FedEM on a frozen ViT: ``components`` shared VPT-shallow prompt+head models, personal mixture weights.

    Algorithm (Marfoq et al., NeurIPS 2021, Alg. 1 and the official code github.com/omarfoq/FedEM,
    ``MixtureClient.step``):
      * Each client t keeps personal mixture weights π_t (uniform at start), its personal state.
      * Local update, with the round's global components Θ = (θ_1..θ_M) and the client's π_t:
        E-step: q(m | x_i, y_i) ∝ π_tm · exp(-CE(f_θm(x_i), y_i)) for every local sample;
        π_t ← mean_i q(m | x_i, y_i);
        M-step: each component m is trained for E local epochs on the weighted loss
        Σ_i q(m | x_i, y_i) · CE(f_θm(x_i), y_i) / |batch| (the official learner's weighted loss).
      * Server: each component is averaged over the uploads with sample-size weights (Alg. 1:
        θ_m = Σ_t (n_t / n) θ_m,t); the mixture weights never leave the client.
      * Personalised prediction: log Σ_m π_tm · softmax(f_θm(x)).

    Choices where the paper is silent or the setting differs (also in DEVIATIONS.md):
      * Components: ``components`` = 3 (FedEM's default; SGPT spec §7.15), each a VPT-shallow prompt
        (``num_prompts`` = 1 token) + linear head sharing the one frozen backbone, instead of whole CNNs.
        They are stored stacked ((M, n, D) prompts, (M, C, D) head) so all M run in one backbone pass and
        the default sample-weighted average of the stacked tensors is exactly the per-component FedAvg.
      * The E-step is computed once per round from the start-of-round Θ and π (as the official client does
        before its local epochs). Batches carry no sample ids, so each training batch's q is recomputed from
        a frozen snapshot of those start-of-round tensors: the same q as the paper's, at the cost of one
        gradient-free forward per step, with no need to hold the client's images (or q) in memory.
      * The M components are trained together on the same batch sequence, one optimiser over the stacked
        tensors (optimisers act element-wise, so this equals M optimisers); the official code iterates the
        loader separately per learner. The optimiser is the experiment's, fresh every round (the official
        learners keep theirs across rounds).
      * A client evaluated before it ever trained uses the uniform π (no evaluation-time EM); the paper's
        separate procedure for clients unseen during training (learn π with Θ fixed) is not run.
      * Reported training loss: the mean M-step loss Σ_m q_m · CE_m over the local epochs.
      * Partial participation: each component is averaged over the round's clients (weights renormalised over
        them, the engine's FedAvg). The official ``CentralizedAggregator`` averages over all clients, the
        unsampled ones holding the previous components (a server step scaled by the sampled share of the data).
      * The E-step reads the training batches; the official code an un-augmented pass (``val_iterator``). The
        same in every SGPT experiment, none of which augments.
    """

    name = "fedem"
    defaults = {"components": 3, "num_prompts": 1}
    param_rules = {"components": Int(1), "num_prompts": Int(1)}
    client_role = FedEMClient
    evaluator_role = FedEMEvaluator

    def build(self, backbone: nn.Module) -> nn.Module:
        """The mixture of ``components`` prompt+head models on the shared frozen backbone."""
        return MixturePromptClassifier(backbone, self.num_classes, int(self.params["components"]),
                                       int(self.params["num_prompts"]))
