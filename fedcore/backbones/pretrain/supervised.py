"""Supervised pretraining of a tiny backbone (ViT or ResNet) on a dataset's held-out `pretrain` split (mini scale):
objective ``supervised`` of config/backbones.yaml's ``pretrain:``."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedcore.backbones.images import to_model_input
from fedcore.backbones.pretrain.common import isolated_torch_state, lr_factor, param_groups, random_shift
from fedcore.backbones.prompted import attention_backend
from fedcore.backbones.registry import arch_spec, build_backbone, input_cfg
from fedcore.data.arrays import DatasetBundle
from fedcore.io import atomic_torch_save


@torch.no_grad()
def _accuracy(model: nn.Module, head: nn.Module, x: Tensor, y: Tensor, info: dict, batch_size: int) -> float:
    """Clean (unaugmented, eval-mode) accuracy of backbone+head on on-device uint8 images."""
    correct = 0
    for s in range(0, len(y), batch_size):
        inp = to_model_input(x[s : s + batch_size], info["img_size"], info["mean"], info["std"])
        correct += int((head(model(inp)).argmax(1) == y[s : s + batch_size]).sum())
    return correct / max(1, len(y))


def pretrain_vit(bundle: DatasetBundle, arch: str = "vit_mini", **kwargs) -> dict:
    """Train `arch` + a temporary linear head on bundle.pretrain; save the backbone state dict (no head) to out_path.

    The historical name of ``pretrain_backbone`` (any ViT or ResNet arch of the registry works), same keywords.
    """
    return pretrain_backbone(bundle, arch, None, **kwargs)


def pretrain_backbone(
    bundle: DatasetBundle,
    arch: str = "vit_mini",
    tag: str | None = None,
    epochs: int = 30,
    batch_size: int = 128,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    seed: int = 0,
    out_path: str | Path | None = None,
    threads: int | None = None,
    progress: bool = True,
    device: str | torch.device = "cpu",
    schedule: str = "cosine",
    max_shift: int | None = None,
    label_smoothing: float = 0.1,
) -> dict:
    """Train registry arch `arch` + a temporary linear head on bundle.pretrain; save the backbone state dict.

    The head reads the ViT's CLS feature or the ResNet's pooled feature; inputs follow weights `arch.tag`
    (img_size, mean, std). Same data, loop and seeds for every arch: vit_mini's result is unchanged.
    """
    family = arch_spec(arch).family
    if family not in ("vit", "resnet"):
        raise ValueError(f"pretraining supports the vit and resnet families; {arch!r} is {family}")
    ds = bundle.pretrain
    if ds is None or len(ds) == 0:
        raise ValueError("the dataset bundle has no pretrain split to pretrain the backbone on")
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
    device = torch.device(device)
    with isolated_torch_state(threads), attention_backend(device):
        torch.default_generator.manual_seed(seed)  # init RNG (CPU only: the caller's CUDA RNG is left alone)
        gen = torch.Generator().manual_seed(seed)  # CPU generator: same shuffles/shifts on every device
        model = build_backbone(arch, None, tag).to(device)
        info = dict(input_cfg(arch, tag), embed_dim=arch_spec(arch).dim)
        num_classes = int(ds.y.max()) + 1  # pretrain labels may differ from the task classes (digits_five)
        head = nn.Linear(info["embed_dim"], num_classes).to(device)
        params = list(model.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(
            param_groups(model, weight_decay) + [dict(params=list(head.parameters()), weight_decay=weight_decay)],
            lr=lr,
        )
        # the whole split lives on the device as uint8; batches are gathered there
        x_all = torch.from_numpy(ds.x).to(device)
        y_all = torch.from_numpy(ds.y).to(device)
        n = len(y_all)
        # ±1 px at 16x16: ±2 px cut off the edges of these tight digit crops and hurt the features
        shift = max_shift if max_shift is not None else max(1, ds.x.shape[1] // 16)
        steps_per_epoch = math.ceil(n / batch_size)
        total = epochs * steps_per_epoch
        step, seen, train_time, loss_val, aug_acc = 0, 0, 0.0, float("nan"), float("nan")
        for epoch in range(epochs):
            model.train()
            head.train()
            perm = torch.randperm(n, generator=gen).to(device)
            # device-side sums: no host sync per step on GPU
            ep_correct = torch.zeros((), dtype=torch.long, device=device)
            ep_loss = torch.zeros((), device=device)
            t0 = time.perf_counter()
            for s in range(0, n, batch_size):
                idx = perm[s : s + batch_size]
                xb = random_shift(x_all[idx], shift, gen) if shift > 0 else x_all[idx]
                inp = to_model_input(xb, info["img_size"], info["mean"], info["std"])
                for g in opt.param_groups:
                    g["lr"] = lr * lr_factor(step, total, schedule)
                logits = head(model(inp))
                loss = F.cross_entropy(logits, y_all[idx], label_smoothing=label_smoothing)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
                ep_loss += loss.detach() * len(idx)
                ep_correct += (logits.detach().argmax(1) == y_all[idx]).sum()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_time += time.perf_counter() - t0
            seen += n
            loss_val, aug_acc = float(ep_loss) / n, int(ep_correct) / n
            if progress:
                print(
                    f"[pretrain {arch}] epoch {epoch + 1}/{epochs} loss {loss_val:.4f} "
                    f"acc {aug_acc:.4f} ({seen / max(train_time, 1e-9):.0f} img/s)",
                    file=sys.stderr,
                    flush=True,
                )
        model.eval()
        head.eval()
        train_acc = _accuracy(model, head, x_all, y_all, info, 4 * batch_size)
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if out_path is not None:
        atomic_torch_save(state, out_path)
    return dict(
        arch=arch,
        epochs=epochs,
        steps=step,
        images=seen,
        num_classes=num_classes,
        train_seconds=train_time,
        images_per_s=seen / max(train_time, 1e-9),
        final_loss=loss_val,
        train_acc=train_acc,  # clean pass over the pretrain split after training
        last_epoch_acc=aug_acc,  # running accuracy of the last epoch, on augmented batches
        backbone_params=sum(p.numel() for p in model.parameters()),
        out_path=None if out_path is None else str(out_path),
        device=str(device),
        threads=torch.get_num_threads() if threads is None else threads,
    )
