"""FedMix (Yoon et al., ICLR 2021): mean-augmented FL with the approximated global-Mixup loss, on VPT + head."""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fedcore.constraints import Int, Number
from fedcore.engine.data import on_device
from fedcore.engine.optim import ClientData, TrainSettings, run_epochs
from fedcore.engine.roles import Client, FitResult, Payload, Strategy
from fedcore.methods import register_method
from fedcore.methods.base import PromptMethod


def client_means(data: ClientData, num_classes: int, mean_batch: int) -> tuple[Tensor, Tensor]:
    """Mean model inputs (G, 3, S, S) and mean one-hot labels (G, C) of groups of ``mean_batch`` local samples."""
    n = data.num_samples
    # 0 (or more than the client holds) means one group of all its samples
    size = n if mean_batch <= 0 or mean_batch > n else int(mean_batch)
    groups = n // size
    sums_x = sums_y = None
    seen = 0
    for batch in data.batches():  # one seeded pass: groups are random subsets of the client's data
        x, y = batch.x, batch.y
        pos = torch.arange(seen, seen + len(y), device=y.device)
        seen += len(y)
        gid = pos // size
        keep = gid < groups  # the last incomplete group is dropped: a mean of few images leaks them
        if sums_x is None:
            sums_x = torch.zeros((groups, *x.shape[1:]), dtype=torch.float32, device=x.device)
            sums_y = torch.zeros((groups, num_classes), dtype=torch.float32, device=x.device)
        sums_x.index_add_(0, gid[keep], x[keep].float())
        sums_y.index_add_(0, gid[keep], F.one_hot(y[keep], num_classes).float())
    if sums_x is None:
        raise ValueError(f"client {data.cid} has no training data to average")
    return sums_x / size, sums_y / size


def fedmix_loss(model: nn.Module, x: Tensor, y: Tensor, x_mean: Tensor, y_mean: Tensor, lam: float) -> Tensor:
    """Batch mean of the FedMix loss l1 + l2 + l3, row i of x_mean/y_mean paired with row i of x/y.

    l1 = (1-lam) CE(f((1-lam) x), y), l2 = lam CE(f((1-lam) x), y_mean),
    l3 = lam <d l1 / d x, x_mean> with the derivative taken at (1-lam) x (first-order Taylor term of global Mixup).
    """
    xs = ((1.0 - lam) * x).detach().requires_grad_(True)
    with sdpa_kernel(SDPBackend.MATH):  # the forward's kernel fixes the backward's: only math has a 2nd derivative
        logits = model(xs).float()
    l1 = (1.0 - lam) * F.cross_entropy(logits, y, reduction="none")
    l2 = lam * F.cross_entropy(logits, y_mean, reduction="none")  # soft targets: the mean labels
    # Samples never interact in the frozen ViT (eval mode, per-token LayerNorm), so the input gradient of the
    # summed loss holds each sample's own d l1_i / d x_i; create_graph lets l3 train the prompts and head.
    (grad_x,) = torch.autograd.grad(l1.sum(), xs, create_graph=True)
    l3 = lam * (grad_x.flatten(1) * x_mean.flatten(1).to(grad_x.dtype)).sum(dim=1)
    return (l1 + l2 + l3).mean()


class FedMixClient(Client):
    """Sends its mean data once; trains with the approximated global-Mixup loss against the pooled means."""

    def setup(self, cid: int, data: ClientData) -> Payload:
        """This client's mean inputs and labels (MAFL's one-time upload)."""
        x, y = client_means(data, self.method.num_classes, int(self.params["mean_batch"]))
        return {"x": x, "y": y}

    def train(self, model: nn.Module, cid: int, state: Payload, downlink: Payload, data: ClientData,
              settings: TrainSettings) -> tuple[dict[str, float], None]:
        """E epochs of the FedMix loss, each sample paired with a random global mean."""
        x_means, y_means = downlink["fedmix_x"], downlink["fedmix_y"]
        lam = float(self.params["lam"])

        def loss_fn(batch) -> Tensor:
            j = on_device(torch.randint(len(y_means), (len(batch.y),), generator=data.generator), batch.y)
            return fedmix_loss(model, batch.x, batch.y, x_means[j].float(), y_means[j], lam)

        named = dict(model.named_parameters())
        params = [named[k] for k in self.method.trainable_keys(cid)]
        return run_epochs(params, data, settings, settings.local_epochs, loss_fn)[0], None


class FedMixServer(Strategy):
    """FedAvg, plus the pool of every client's means, sent with every downlink."""

    def setup(self, state: Payload, uplinks: list[FitResult]) -> None:
        """Pool the clients' means (in client order)."""
        state["fedmix_x"] = torch.cat([u.uplink["x"] for u in uplinks]).to(torch.float16)  # halves 224 px memory
        state["fedmix_y"] = torch.cat([u.uplink["y"] for u in uplinks])

    def configure(self, state: Payload, cid: int) -> Payload:
        """The global model and the pooled means."""
        return {"model": state["model"], "fedmix_x": state["fedmix_x"], "fedmix_y": state["fedmix_y"]}


@register_method
class FedMix(PromptMethod):
    """FedMix on a frozen ViT: VPT-shallow prompts + linear head, trained with the approximated global-Mixup loss.

    Algorithm (Yoon et al., ICLR 2021, MAFL + FedMix):
      1. Once before round 1 (``Client.setup``), every client averages its local samples in groups of ``mean_batch``
         (the paper's M_k) into mean inputs x̄ and mean one-hot labels ȳ and sends them; the server pools
         them (X_g, Y_g) in its state (``fedmix_x``, ``fedmix_y``, ``Strategy.setup``) and sends them in every downlink.
      2. Local update: for every local sample (x_i, y_i) a global mean (x̄_j, ȳ_j) is drawn and the loss is
         l1 + l2 + l3 with l1 = (1-λ)·CE(f((1-λ)x_i), y_i), l2 = λ·CE(f((1-λ)x_i), ȳ_j) and
         l3 = λ·<∂l1/∂x, x̄_j> (derivative at (1-λ)x_i), the first-order Taylor approximation of Mixup
         between x_i and the raw data of other clients. l3 needs a double backward through the frozen ViT.
      3. Server: FedAvg (sample-size weights) of prompts and head. One global model.

    Choices where the paper is silent or the setting differs (also in DEVIATIONS.md):
      * Model: the paper trains a whole CNN; here only VPT-shallow prompts (``num_prompts`` = 1, SGPT spec
        §7.15) and the head on the frozen backbone, with the experiment's optimiser, batch, E and rounds
        (the paper's per-round lr decay 0.999 is not used: every baseline shares one optimiser config).
      * ``lam`` = 0.1: the FedMix paper's value for CIFAR-100 (0.05 CIFAR-10, 0.2 FEMNIST), which is also
        the middle of the spec's tuning grid {0.05, 0.1, 0.2}; SGPT's main benchmark is CIFAR-100.
      * ``mean_batch`` = 0 means one mean of the client's whole local set, as the Flower reproduction of the
        paper (adap/flower baselines/fedmix, "mash batch size: all") configures every experiment; a positive
        value averages random groups of that size (a seeded shuffle) and drops the last incomplete group.
      * Means are of model-ready inputs (after the pipeline's normalisation and resize). That pipeline is
        affine + bilinear, both linear with weights summing to one, so this equals transforming the mean of
        the raw images. They are stored as float16 on the run's device (~300 KB per mean at 224 px) and are
        part of the checkpoint; ``mean_batch`` > 0 at paper scale multiplies that size by N_k / M_k.
      * The scaling (1-λ)x and the term l3 act on the model input, i.e. the normalised tensor the network sees
        (the paper does not say whether its inputs were normalised).
      * The pool holds every client's means, the client's own included (the server broadcasts one X_g).
        The paper's average over the means j is estimated by drawing one mean per local sample and step,
        uniformly, from the client's seeded generator (Flower draws one per batch).
      * l3 uses per-sample input gradients as the paper's formula states; differentiating the batch-mean l1
        instead (as the Flower code does) would shrink l3 by the batch size.
      * The double backward runs with PyTorch's math attention kernel (the fused/flash kernels have no second
        derivative), so FedMix local updates are slower and use more memory than FedVPT's.
    """

    name = "fedmix"
    prompt_mode = "shallow"
    defaults = {"num_prompts": 1, "lam": 0.1, "mean_batch": 0}
    param_rules = {"num_prompts": Int(1), "lam": Number(0.0, 1.0, hi_open=True), "mean_batch": Int(0)}
    client_role = FedMixClient
    strategy_role = FedMixServer
