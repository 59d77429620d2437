"""Contrastive image-text (CLIP) pretraining of a tiny open_clip CLIP on a dataset's held-out `pretrain` split.

CLIP (Radford et al. 2021) scaled down to the mini scale, for FedOTP's frozen CLIP (spec fedotp §1.1, §8.21):

* captions made from the labels: each image, each step, gets one of ``TEMPLATES`` drawn at random, filled with
  its class's word (``meta["pretrain_clip_names"]``: "zero" .. "nine") and, for the templates that name it, its
  style (the split is rendered in every style; ``domain`` indexes ``meta["styles"]``);
* symmetric InfoNCE between the batch's normalised image and caption features with a learnable logit scale
  (init 1/0.07, clamped at 100 as CLIP). Only the batch's distinct captions are encoded: images that drew the
  same caption share one column, so they are not each other's negatives (with ten classes a batch repeats
  captions often; CLIP's web captions rarely repeat). Image -> text is cross-entropy over those captions; text
  -> image spreads its target uniformly over the images that drew the caption;
* ±1 px random shifts, AdamW with timm-style groups, warm-up then cosine, as the supervised pretraining.

The whole CLIP (both towers and the logit scale) is saved; ``zero_shot_accuracy`` measures what FedOTP's
zero-shot baseline measures ("a photo of a {class}.").
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedcore.backbones.clip import encode_token_ids, tokenize
from fedcore.backbones.images import to_model_input
from fedcore.backbones.pretrain.common import isolated_torch_state, lr_factor, random_shift
from fedcore.backbones.prompted import attention_backend
from fedcore.backbones.registry import arch_spec, build_backbone, input_cfg
from fedcore.data.arrays import DatasetBundle
from fedcore.io import atomic_torch_save

# Caption templates; {name}: the class word, {style}: the image's style. The zero-shot prompt of the FedOTP code
# ("a photo of a {}.", trainers/clip.py) is one of them, as CLIP's web captions contain such phrases.
TEMPLATES = (
    "a photo of a {name}.",
    "a photo of the digit {name}.",
    "a {style} photo of the digit {name}.",
    "a {style} image of the number {name}.",
    "the number {name}, {style}.",
)
ZERO_SHOT_TEMPLATE = "a photo of a {name}."
MAX_LOGIT_SCALE = 100.0  # CLIP clamps exp(logit_scale) at 100


def captions(names: list[str], styles: list[str]) -> list[str]:
    """Every caption, indexed ((template * len(styles)) + style) * len(names) + class."""
    return [t.format(name=n, style=s) for t in TEMPLATES for s in styles for n in names]


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay for gains, biases, the logit scale, embeddings of positions and the class token."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        flat = p.ndim <= 1 or name.endswith(("positional_embedding", "class_embedding"))
        (no_decay if flat else decay).append(p)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


def clip_loss(image_features: Tensor, caption_features: Tensor, caption_of_image: Tensor,
              logit_scale: Tensor) -> Tensor:
    """Symmetric InfoNCE between B images and their U distinct captions (caption_of_image: (B,) in 0..U-1)."""
    img = F.normalize(image_features, dim=-1)
    txt = F.normalize(caption_features, dim=-1)
    logits = logit_scale * img @ txt.T  # (B, U)
    to_text = F.cross_entropy(logits, caption_of_image)
    targets = F.one_hot(caption_of_image, len(txt)).T.float()  # (U, B): the images that drew each caption
    to_image = F.cross_entropy(logits.T, targets / targets.sum(1, keepdim=True))
    return 0.5 * (to_text + to_image)


@torch.no_grad()
def zero_shot_accuracy(clip: nn.Module, x_uint8: Tensor, y: Tensor, names: list[str], info: dict,
                       template: str = ZERO_SHOT_TEMPLATE, batch_size: int = 512) -> float:
    """Top-1 accuracy of zero-shot CLIP on uint8 images: nearest normalised prompt `template` of each class."""
    was = clip.training
    clip.eval()
    ids = tokenize([template.format(name=n) for n in names], int(clip.context_length))
    text = F.normalize(encode_token_ids(clip, ids), dim=-1)
    correct = 0
    for s in range(0, len(y), batch_size):
        inp = to_model_input(x_uint8[s : s + batch_size], info["img_size"], info["mean"], info["std"])
        pred = (F.normalize(clip.encode_image(inp), dim=-1) @ text.T).argmax(1)
        correct += int((pred == y[s : s + batch_size].to(pred.device)).sum())
    clip.train(was)
    return correct / max(1, len(y))


def pretrain_clip(
    bundle: DatasetBundle,
    arch: str = "clip_mini",
    tag: str | None = None,
    epochs: int = 20,
    batch_size: int = 128,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    max_shift: int = 1,
    seed: int = 0,
    out_path: str | Path | None = None,
    threads: int | None = None,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> dict:
    """Pretrain registry CLIP `arch` on bundle.pretrain's images and label captions; save the whole CLIP."""
    if arch_spec(arch).family != "clip":
        raise ValueError(f"CLIP pretraining needs a clip-family arch; {arch!r} is {arch_spec(arch).family}")
    ds = bundle.pretrain
    if ds is None or len(ds) == 0:
        raise ValueError("the dataset bundle has no pretrain split to pretrain the CLIP on")
    names = bundle.meta.get("pretrain_clip_names")
    if not names or len(names) <= int(ds.y.max()):
        raise ValueError(f"CLIP pretraining needs meta['pretrain_clip_names'], a caption word per pretrain label "
                         f"(0..{int(ds.y.max())}); the bundle has {names!r}")
    styles = list(bundle.meta.get("styles", ["clean"])) if ds.domain is not None else ["clean"]
    device = torch.device(device)
    with isolated_torch_state(threads), attention_backend(device):
        torch.default_generator.manual_seed(seed)  # init RNG (CPU only: the caller's CUDA RNG is left alone)
        gen = torch.Generator().manual_seed(seed)  # CPU generator: same shuffles, shifts, captions on every device
        info = input_cfg(arch, tag)
        model = build_backbone(arch, None, tag).to(device)
        all_ids = tokenize(captions(list(names), styles), int(model.context_length)).to(device)
        opt = torch.optim.AdamW(_param_groups(model, weight_decay), lr=lr)
        x_all = torch.from_numpy(ds.x).to(device)
        y_all = torch.from_numpy(ds.y).to(device)
        style_all = (torch.from_numpy(ds.domain) if ds.domain is not None else torch.zeros_like(y_all.cpu())).to(device)
        n, n_names, n_styles = len(y_all), len(names), len(styles)
        total = epochs * -(-n // batch_size)
        step, train_time, loss_val = 0, 0.0, float("nan")
        model.train()
        for epoch in range(epochs):
            perm = torch.randperm(n, generator=gen).to(device)
            ep_loss = torch.zeros((), device=device)
            t0 = time.perf_counter()
            for s in range(0, n, batch_size):
                idx = perm[s : s + batch_size]
                xb = random_shift(x_all[idx], max_shift, gen) if max_shift > 0 else x_all[idx]
                template = torch.randint(len(TEMPLATES), (len(idx),), generator=gen).to(device)
                cap = (template * n_styles + style_all[idx]) * n_names + y_all[idx]
                uniq, inverse = torch.unique(cap, return_inverse=True)
                for g in opt.param_groups:
                    g["lr"] = lr * lr_factor(step, total, "cosine")
                image_features = model.encode_image(to_model_input(xb, info["img_size"], info["mean"], info["std"]))
                loss = clip_loss(image_features, encode_token_ids(model, all_ids[uniq]), inverse,
                                 model.logit_scale.exp())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                with torch.no_grad():
                    model.logit_scale.clamp_(0.0, float(torch.log(torch.tensor(MAX_LOGIT_SCALE))))
                step += 1
                ep_loss += loss.detach() * len(idx)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_time += time.perf_counter() - t0
            loss_val = float(ep_loss) / n
            if progress:
                scale = float(model.logit_scale.detach().exp())
                print(f"[pretrain {arch} clip] epoch {epoch + 1}/{epochs} loss {loss_val:.4f} logit scale {scale:.1f} "
                      f"({(epoch + 1) * n / max(train_time, 1e-9):.0f} img/s)", file=sys.stderr, flush=True)
        model.eval()
        zero_shot = zero_shot_accuracy(model, x_all, y_all, list(names), info)
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if out_path is not None:
        atomic_torch_save(state, out_path)
    return dict(
        arch=arch,
        objective="clip",
        epochs=epochs,
        steps=step,
        images=epochs * n,
        train_seconds=train_time,
        images_per_s=epochs * n / max(train_time, 1e-9),
        final_loss=loss_val,
        logit_scale=float(model.logit_scale.detach().exp()),
        zero_shot_acc=zero_shot,  # "a photo of a {name}." on the (clean, unshifted) pretrain split
        params=sum(p.numel() for p in model.parameters()),
        out_path=None if out_path is None else str(out_path),
        device=str(device),
        threads=torch.get_num_threads() if threads is None else threads,
    )
