"""Contrastive image-text pretraining of the mini CLIP (fedcore.backbones.pretrain.clip)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedcore.backbones.pretrain import objective_keys, pretrain
from fedcore.backbones.pretrain.clip import TEMPLATES, captions, clip_loss
from fedcore.backbones.registry import build_backbone
from fedcore.data.arrays import ArrayDataset, DatasetBundle
from fedcore.data.embedded import DIGIT_WORDS, build_embedded

torch.set_num_threads(1)


def _bundle(n: int = 48, names: list[str] | None = list(DIGIT_WORDS)) -> DatasetBundle:
    """The embedded digits with the first `n` pretrain images (several styles)."""
    b = build_embedded("digits")
    pre = b.pretrain
    rows = np.random.default_rng(0).choice(len(pre), n, replace=False)
    meta = {k: v for k, v in b.meta.items() if k != "pretrain_clip_names" or names is not None}
    if names is not None:
        meta["pretrain_clip_names"] = names
    return DatasetBundle(b.train, b.test, ArrayDataset(pre.x[rows], pre.y[rows], pre.domain[rows]), meta)


def test_loss_is_clip_loss_and_shares_repeated_captions() -> None:
    g = torch.Generator().manual_seed(0)
    img, txt, scale = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g), torch.tensor(20.0)
    logits = scale * F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T
    target = torch.arange(5)  # distinct captions: CLIP's own symmetric loss
    ref = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
    torch.testing.assert_close(clip_loss(img, txt, target, scale), ref)
    # images 0 and 2 drew caption 0: image -> text targets it, text -> image spreads over both images
    inverse = torch.tensor([0, 1, 0, 2, 3])
    logits = logits[:, :4]
    to_image = -(0.5 * (logits.T[0].log_softmax(0)[0] + logits.T[0].log_softmax(0)[2])
                 + sum(logits.T[u].log_softmax(0)[i] for u, i in ((1, 1), (2, 3), (3, 4)))) / 4
    ref = 0.5 * (F.cross_entropy(logits, inverse) + to_image)
    torch.testing.assert_close(clip_loss(img, txt[:4], inverse, scale), ref)


def test_captions_name_class_and_style() -> None:
    caps = captions(["zero", "one"], ["clean", "inverted"])
    assert len(caps) == len(TEMPLATES) * 4 and caps[0] == "a photo of a zero."
    assert "a inverted photo of the digit one." in caps  # (template 2, style 1, class 1)
    assert caps[(2 * 2 + 1) * 2 + 1] == "a inverted photo of the digit one."


def test_pretraining_is_seeded_and_clamps_the_logit_scale(tmp_path) -> None:
    kw = dict(epochs=1, batch_size=24, threads=1, progress=False)
    s1 = pretrain(_bundle(), "clip_mini", objective="clip", out_path=tmp_path / "a.pt", **kw)
    pretrain(_bundle(), "clip_mini", objective="clip", out_path=tmp_path / "b.pt", **kw)
    pretrain(_bundle(), "clip_mini", objective="clip", out_path=tmp_path / "c.pt", seed=1, **kw)
    w1, w2, w3 = (torch.load(tmp_path / f"{n}.pt") for n in "abc")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not all(torch.equal(w1[k], w3[k]) for k in w1)
    assert s1["steps"] == 2 and s1["objective"] == "clip" and math.isfinite(s1["final_loss"])
    assert 0.0 <= s1["zero_shot_acc"] <= 1.0 and torch.get_num_threads() == 1
    model = build_backbone("clip_mini", tmp_path / "a.pt")  # the whole CLIP, loaded strictly through the registry
    assert torch.equal(model.logit_scale.detach(), w1["logit_scale"])
    # a huge lr throws the logit scale far past CLIP's bounds: the clamp keeps exp(scale) in [1, 100]
    s = pretrain(_bundle(), "clip_mini", objective="clip", epochs=1, batch_size=48, lr=50.0, progress=False)
    assert 1.0 <= s["logit_scale"] <= 100.0 and s["logit_scale"] in (pytest.approx(1.0), pytest.approx(100.0))


def test_bad_pretraining_inputs_are_named() -> None:
    assert {"epochs", "batch_size", "lr", "weight_decay", "max_shift"} == set(objective_keys("clip"))
    with pytest.raises(ValueError, match="pretrain_clip_names"):
        pretrain(_bundle(names=None), "clip_mini", objective="clip", epochs=1, progress=False)
    with pytest.raises(ValueError, match="clip-family arch; 'vit_mini' is vit"):
        pretrain(_bundle(), "vit_mini", objective="clip", epochs=1, progress=False)
