"""Self-supervised MoCo v3-style pretraining of a tiny ViT on a dataset's held-out `pretrain` split (mini scale).

MoCo v3 (Chen, Xie & He, ICCV 2021; facebookresearch/moco-v3 ``moco/builder.py``, ``main_moco.py``), scaled down
to the mini backbones, and never reading a label:

* two augmented views of every image, made on the fly on the device (random resized crop, brightness and
  contrast jitter; ``two_views``);
* the base encoder = backbone (its CLS feature) + a 3-layer projection MLP, followed by a 2-layer prediction
  MLP, gives the queries; a momentum copy of the base encoder, not trained by gradient, gives the keys;
* InfoNCE with temperature τ over the batch (the other images' keys are the negatives), times 2τ as the repo
  does, symmetric over the views: ``ctr(q1, k2) + ctr(q2, k1)`` (``moco_loss``);
* before the keys are computed, every step, θ_k ← m θ_k + (1 − m) θ_q with m rising from ``momentum`` to 1 on a
  half cosine over training (the repo's ``--moco-m-cos``; ``momentum_update``, ``moco_momentum``).

Only the backbone is saved: the heads are dropped, as the repo's linear evaluation drops them. The choices made
for the tiny scale (head widths, augmentations, AdamW groups as the supervised pretraining) are in
DEVIATIONS.md ("FedHPL with self-supervised backbones").
"""
from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedcore.backbones.prompted import attention_backend
from fedcore.backbones.pretrain.common import isolated_torch_state, lr_factor, param_groups
from fedcore.backbones.registry import arch_spec, build_backbone, input_cfg
from fedcore.data.arrays import DatasetBundle
from fedcore.io import atomic_torch_save

ASPECT = (3 / 4, 4 / 3)  # random resized crop aspect-ratio range (torchvision's default)


def build_mlp(num_layers: int, input_dim: int, mlp_dim: int, output_dim: int, last_bn: bool = True) -> nn.Sequential:
    """MoCo v3's MLP: Linear (no bias) -> BN -> ReLU per hidden layer; the output Linear followed by a BN without
    affine parameters when `last_bn` (moco/builder.py ``_build_mlp``)."""
    layers: list[nn.Module] = []
    for i in range(num_layers):
        d_in = input_dim if i == 0 else mlp_dim
        d_out = output_dim if i == num_layers - 1 else mlp_dim
        layers.append(nn.Linear(d_in, d_out, bias=False))
        if i < num_layers - 1:
            layers += [nn.BatchNorm1d(d_out), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(nn.BatchNorm1d(d_out, affine=False))
    return nn.Sequential(*layers)


class MoCoV3(nn.Module):
    """Base encoder (backbone + projector), predictor, and the momentum (key) encoder, a frozen copy of the base."""

    def __init__(self, backbone: nn.Module, feature_dim: int, proj_dim: int, mlp_dim: int) -> None:
        super().__init__()
        self.base = nn.Sequential(backbone, build_mlp(3, feature_dim, mlp_dim, proj_dim))
        self.predictor = build_mlp(2, proj_dim, mlp_dim, proj_dim)
        self.momentum = copy.deepcopy(self.base)  # starts equal to the base encoder (the repo copies it)
        for p in self.momentum.parameters():
            p.requires_grad_(False)

    def forward(self, v1: Tensor, v2: Tensor, m: float, temperature: float) -> Tensor:
        """The symmetric loss of one batch of view pairs; updates the key encoder with momentum `m` first."""
        q1, q2 = self.predictor(self.base(v1)), self.predictor(self.base(v2))
        with torch.no_grad():
            momentum_update(self.base, self.momentum, m)
            k1, k2 = self.momentum(v1), self.momentum(v2)
        return moco_loss(q1, q2, k1, k2, temperature)


def contrastive_loss(q: Tensor, k: Tensor, temperature: float) -> Tensor:
    """InfoNCE of queries `q` against keys `k` (row i's positive is key i, the others its negatives), times 2τ."""
    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    logits = q @ k.T / temperature
    return F.cross_entropy(logits, torch.arange(len(q), device=q.device)) * (2 * temperature)


def moco_loss(q1: Tensor, q2: Tensor, k1: Tensor, k2: Tensor, temperature: float) -> Tensor:
    """MoCo v3's symmetric loss: each view's queries against the other view's keys."""
    return contrastive_loss(q1, k2, temperature) + contrastive_loss(q2, k1, temperature)


@torch.no_grad()
def momentum_update(base: nn.Module, key: nn.Module, m: float) -> None:
    """θ_k ← m θ_k + (1 − m) θ_q for every parameter (buffers such as BN statistics stay the key encoder's own)."""
    for p_q, p_k in zip(base.parameters(), key.parameters(), strict=True):
        p_k.mul_(m).add_(p_q.detach(), alpha=1.0 - m)


def moco_momentum(step: int, total: int, base: float) -> float:
    """The key encoder's momentum at `step` of `total`: `base` rising to 1 on a half cosine (--moco-m-cos)."""
    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * step / max(1, total))) * (1.0 - base)


def two_views(x_uint8: Tensor, generator: torch.Generator, crop_min: float, jitter: float, img_size: int,
              mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[Tensor, Tensor]:
    """Two independently augmented, normalised views (B,3,S,S) of uint8 (B,H,W,3) images.

    Each view: a random resized crop (area fraction U(crop_min, 1), aspect ratio log-uniform in 3/4..4/3, placed
    uniformly inside the image, resampled bilinearly to the image size), then brightness and contrast factors
    U(1 − jitter, 1 + jitter). Every draw comes from the CPU `generator`: the same views on every device.
    """
    x = x_uint8.permute(0, 3, 1, 2).float() / 255.0
    m = torch.tensor(mean, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, device=x.device).view(1, 3, 1, 1)
    return tuple(_one_view(x, generator, crop_min, jitter, img_size, m, s) for _ in range(2))  # type: ignore[return-value]


def _one_view(x: Tensor, gen: torch.Generator, crop_min: float, jitter: float, img_size: int, mean: Tensor,
              std: Tensor) -> Tensor:
    """One augmented view of float images in [0, 1] (B,3,H,W), normalised."""
    b = len(x)
    u = torch.rand(b, 6, generator=gen).to(x.device)
    area = crop_min + (1.0 - crop_min) * u[:, 0]
    log_r = math.log(ASPECT[0]) + (math.log(ASPECT[1]) - math.log(ASPECT[0])) * u[:, 1]
    w = (area * log_r.exp()).sqrt().clamp(max=1.0)  # crop width and height as fractions of the image
    h = (area / log_r.exp()).sqrt().clamp(max=1.0)
    cx, cy = (1.0 - w) * (2 * u[:, 2] - 1), (1.0 - h) * (2 * u[:, 3] - 1)  # crop centre in [-1, 1] coordinates
    zero = torch.zeros_like(w)
    theta = torch.stack([torch.stack([w, zero, cx], 1), torch.stack([zero, h, cy], 1)], 1)
    grid = F.affine_grid(theta, [b, 3, img_size, img_size], align_corners=False)
    v = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    contrast = (1.0 - jitter + 2 * jitter * u[:, 4]).view(b, 1, 1, 1)
    bright = (1.0 - jitter + 2 * jitter * u[:, 5]).view(b, 1, 1, 1)
    mu = v.mean(dim=(1, 2, 3), keepdim=True)
    v = (((v - mu) * contrast + mu) * bright).clamp(0.0, 1.0)
    return (v - mean) / std


def pretrain_moco(
    bundle: DatasetBundle,
    arch: str = "vit_mini",
    tag: str | None = None,
    epochs: int = 20,
    batch_size: int = 32,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    temperature: float = 0.2,
    momentum: float = 0.95,
    proj_dim: int = 64,
    mlp_dim: int = 256,
    crop_min: float = 0.4,
    jitter: float = 0.4,
    seed: int = 0,
    out_path: str | Path | None = None,
    threads: int | None = None,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> dict:
    """Pretrain registry ViT `arch` by MoCo v3 on bundle.pretrain's images (labels unused); save the backbone.

    Full batches only (the last partial batch of an epoch is dropped, as the repo's loader does: BatchNorm and
    the in-batch negatives want full batches). lr: linear warm-up then cosine, as the supervised pretraining.
    """
    if arch_spec(arch).family != "vit":
        raise ValueError(f"MoCo pretraining is written for ViTs (the CLS feature); {arch!r} is {arch_spec(arch).family}")
    ds = bundle.pretrain
    if ds is None or len(ds) < batch_size:
        raise ValueError(f"MoCo pretraining needs a pretrain split of at least batch_size={batch_size} images; "
                         f"the bundle has {0 if ds is None else len(ds)}")
    device = torch.device(device)
    with isolated_torch_state(threads), attention_backend(device):
        torch.default_generator.manual_seed(seed)  # init RNG (CPU only: the caller's CUDA RNG is left alone)
        gen = torch.Generator().manual_seed(seed)  # CPU generator: the same shuffles and views on every device
        info = input_cfg(arch, tag)
        model = MoCoV3(build_backbone(arch, None, tag), arch_spec(arch).dim, proj_dim, mlp_dim).to(device)
        trained = nn.ModuleList([model.base, model.predictor])  # the key encoder learns by momentum only
        opt = torch.optim.AdamW(param_groups(trained, weight_decay), lr=lr)
        x_all = torch.from_numpy(ds.x).to(device)
        n = len(x_all)
        steps_per_epoch = n // batch_size
        total = epochs * steps_per_epoch
        step, train_time, loss_val = 0, 0.0, float("nan")
        model.train()
        for epoch in range(epochs):
            perm = torch.randperm(n, generator=gen).to(device)
            ep_loss = torch.zeros((), device=device)
            t0 = time.perf_counter()
            for s in range(steps_per_epoch):
                idx = perm[s * batch_size : (s + 1) * batch_size]
                v1, v2 = two_views(x_all[idx], gen, crop_min, jitter, info["img_size"], info["mean"], info["std"])
                for g in opt.param_groups:
                    g["lr"] = lr * lr_factor(step, total, "cosine")
                loss = model(v1, v2, moco_momentum(step, total, momentum), temperature)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                ep_loss += loss.detach()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_time += time.perf_counter() - t0
            loss_val = float(ep_loss) / steps_per_epoch
            if progress:
                print(f"[pretrain {arch} moco] epoch {epoch + 1}/{epochs} loss {loss_val:.4f} "
                      f"({step * batch_size / max(train_time, 1e-9):.0f} img/s)", file=sys.stderr, flush=True)
        backbone = model.base[0].eval()
        state = {k: v.detach().to("cpu").contiguous() for k, v in backbone.state_dict().items()}
    if out_path is not None:
        atomic_torch_save(state, out_path)
    return dict(
        arch=arch,
        objective="moco",
        epochs=epochs,
        steps=step,
        images=step * batch_size,  # images seen (each as two views)
        train_seconds=train_time,
        images_per_s=step * batch_size / max(train_time, 1e-9),
        final_loss=loss_val,
        backbone_params=sum(p.numel() for p in backbone.parameters()),
        out_path=None if out_path is None else str(out_path),
        device=str(device),
        threads=torch.get_num_threads() if threads is None else threads,
    )
