"""Backbones: builder and weight files, image conversion, prompted forward (VPT/SGPT), tiny-ViT pretraining."""
from __future__ import annotations

import numpy as np
import pytest
import timm
from timm.models.vision_transformer import VisionTransformer
import torch
import torch.nn.functional as F

from fedcore.backbones.images import to_model_input
from fedcore.backbones.pretrain.common import random_shift
from fedcore.backbones.pretrain.supervised import pretrain_vit
from fedcore.backbones.prompted import PromptedViT, attention_backend, init_prompts
from fedcore.backbones.vit import ARCHS, backbone_info, build_vit
from fedcore.data.arrays import ArrayDataset, DatasetBundle

torch.set_num_threads(1)  # a 2nd thread slows tiny models (and later tests) on a 2-core machine


def _mini(seed: int = 0) -> torch.nn.Module:
    """A randomly initialised vit_mini."""
    torch.manual_seed(seed)
    return build_vit("vit_mini").eval()


def _tiny_timm(depth: int = 2) -> torch.nn.Module:
    """The small timm ViT of ecosystem.md §C (32x32 input, 64 patches + CLS)."""
    torch.manual_seed(1)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, embed_dim=48, depth=depth,
        num_heads=3, num_classes=0,
    ).eval()


def _x(vit: torch.nn.Module, b: int = 3, seed: int = 0) -> torch.Tensor:
    """Random model input of the right size."""
    s = vit.patch_embed.img_size[0]
    return torch.randn(b, 3, s, s, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make", [_mini, _tiny_timm])
def test_zero_prompts_match_plain_timm(make) -> None:
    vit = make()
    pv = PromptedViT(vit)
    x = _x(vit)
    with torch.no_grad():
        ref_ff, ref = vit.forward_features(x), vit(x)
        for prompts in (None, {}):
            tok = pv.forward_tokens(x, prompts)
            assert tok.shape == ref_ff.shape
            torch.testing.assert_close(pv.cls_token(tok), ref_ff[:, 0], atol=1e-6, rtol=0)
            torch.testing.assert_close(pv.cls_token(tok), ref, atol=1e-6, rtol=0)
            torch.testing.assert_close(pv(x), ref, atol=1e-6, rtol=0)


def test_insert_accumulates_tokens() -> None:
    vit = _tiny_timm(depth=8)
    pv, d = PromptedViT(vit), vit.embed_dim
    x = _x(vit, b=2)
    # SGPT CIFAR s=10 layout: shared at {0,1,2,3}, group at {4,5,6} -> 65 + 7 tokens
    prompts = {i: torch.randn(1, d) for i in range(7)}
    assert pv.forward_tokens(x, prompts).shape == (2, 65 + 7, d)
    # on vit_mini (4 blocks): 17 + 4, and a block taking several tokens at once
    pm = PromptedViT(_mini())
    xm = _x(pm.vit, b=2)
    assert pm.forward_tokens(xm, {i: torch.randn(1, 64) for i in range(4)}).shape == (2, 17 + 4, 64)
    assert pm.forward_tokens(xm, {0: torch.randn(3, 64), 2: torch.randn(1, 64)}).shape == (2, 17 + 4, 64)


def test_insert_places_tokens_after_cls() -> None:
    pv = PromptedViT(_mini())
    x = _x(pv.vit, b=2)
    p0, p1 = torch.randn(1, 64), torch.randn(1, 64)
    # run by hand: block 0 sees [cls, p0, E], block 1 sees [cls, p1, p0', E'] (SGPT's rule)
    v = pv.vit
    h = v.norm_pre(v.patch_drop(v._pos_embed(v.patch_embed(x))))
    h = v.blocks[0](torch.cat([h[:, :1], p0.expand(2, -1, -1), h[:, 1:]], 1))
    h = v.blocks[1](torch.cat([h[:, :1], p1.expand(2, -1, -1), h[:, 1:]], 1))
    for blk in v.blocks[2:]:
        h = blk(h)
    with torch.no_grad():
        torch.testing.assert_close(pv.forward_tokens(x, {0: p0, 1: p1}), v.norm(h), atol=1e-6, rtol=0)


def test_replace_keeps_count_and_shallow_equals_insert() -> None:
    pv = PromptedViT(_mini())
    x = _x(pv.vit)
    deep = {i: torch.randn(5, 64) for i in range(4)}
    with torch.no_grad():
        out = pv.forward_tokens(x, deep, mode="replace")
        assert out.shape == (3, 17 + 5, 64)
        shallow = {0: deep[0]}
        torch.testing.assert_close(
            pv.forward_tokens(x, shallow, mode="replace"), pv.forward_tokens(x, shallow, mode="insert")
        )
        # replacing changes the result (the block-1 prompts are really used)
        assert not torch.allclose(out, pv.forward_tokens(x, shallow, mode="replace"))


def test_per_sample_prompts() -> None:
    pv = PromptedViT(_mini())
    x = _x(pv.vit, b=1).expand(4, -1, -1, -1)  # same image 4 times: differences come from prompts only
    bank = torch.randn(3, 1, 64)  # 3 groups, 1 token each (SGPT group prompts)
    shared = {0: torch.randn(1, 64)}
    with torch.no_grad():
        same = pv.forward_tokens(x, {**shared, 2: bank[torch.tensor([1, 1, 1, 1])]})
        torch.testing.assert_close(same, pv.forward_tokens(x, {**shared, 2: bank[1]}), atol=1e-6, rtol=0)
        diff = pv.forward_tokens(x, {**shared, 2: bank[torch.tensor([0, 1, 2, 0])]})
        cls = pv.cls_token(diff)
        assert not torch.allclose(cls[0], cls[1]) and not torch.allclose(cls[1], cls[2])
        torch.testing.assert_close(cls[0], cls[3])
        with pytest.raises(ValueError):
            pv.forward_tokens(x, {2: bank[:2]})  # batch of 2 prompts for 4 images


def test_gradients_reach_prompts_only() -> None:
    pv = PromptedViT(_mini())
    pv.train()
    assert not pv.vit.training  # backbone stays in eval mode
    p = {0: init_prompts(2, 64, 4), 3: init_prompts(1, 64, 4)}
    pv.forward_tokens(_x(pv.vit), p).sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in p.values())
    assert all(q.grad is None and not q.requires_grad for q in pv.vit.parameters())


def test_init_prompts_range() -> None:
    p = init_prompts(1000, 768, 16)
    assert p.shape == (1000, 768) and p.requires_grad
    assert p.abs().max() <= 0.0625 and p.abs().max() > 0.06  # sqrt(6/(3*256+768)) = 0.0625


def test_stop_block() -> None:
    pv = PromptedViT(_mini())
    x = _x(pv.vit)
    v = pv.vit
    with torch.no_grad():
        h = v.norm_pre(v.patch_drop(v._pos_embed(v.patch_embed(x))))
        for blk in v.blocks[:2]:
            h = blk(h)
        torch.testing.assert_close(pv.forward_tokens(x, stop_block=1), v.norm(h), atol=1e-6, rtol=0)
        torch.testing.assert_close(pv.forward_tokens(x, stop_block=3), pv.forward_tokens(x))
    with pytest.raises(ValueError):
        pv.forward_tokens(x, stop_block=4)
    with pytest.raises(ValueError):
        pv.forward_tokens(x, {4: torch.randn(1, 64)})  # vit_mini has blocks 0..3


def test_collect_is_one_pass_of_stopped_forwards() -> None:
    pv = PromptedViT(_mini())
    x = _x(pv.vit)
    p = {0: torch.randn(2, 64), 2: torch.randn(1, 64)}
    with torch.no_grad():
        got = pv.forward_tokens(x, p, mode="replace", collect=[2, 0, 2])
        assert sorted(got) == [0, 2]
        for b in (0, 2):
            assert torch.equal(got[b], pv.forward_tokens(x, p, mode="replace", stop_block=b))
        cls = pv.cls_features(x, [1, 3])
        assert torch.equal(cls[3], pv(x)) and torch.equal(cls[1], pv.forward_tokens(x, stop_block=1)[:, 0])
        # timm's own intermediates API (final norm applied) agrees without prompts (vit_mini is a PlainViT:
        # the same weights in timm's class)
        vit = VisionTransformer(img_size=16, patch_size=4, embed_dim=64, depth=4, num_heads=4, num_classes=0)
        vit.load_state_dict(pv.vit.state_dict())
        ref = vit.forward_intermediates(x, indices=[1, 3], norm=True, output_fmt="NLC",
                                        intermediates_only=True, return_prefix_tokens=True)
        for b, (_, prefix) in zip((1, 3), ref):
            torch.testing.assert_close(cls[b], prefix[:, 0], atol=1e-6, rtol=0)
    for bad in ([], [4], [-1]):
        with pytest.raises(ValueError, match="collect"):
            pv.forward_tokens(x, collect=bad)
    with pytest.raises(ValueError, match="stop_block"):
        pv.forward_tokens(x, stop_block=1, collect=[2])
    assert pv.feature_dim == pv.embed_dim == 64


def test_cpu_math_attention_matches_default() -> None:
    pv = PromptedViT(_mini())
    x, p = _x(pv.vit), {1: torch.randn(2, 64)}
    with torch.no_grad():
        ref = pv.forward_tokens(x, p)
        with attention_backend(x.device):
            torch.testing.assert_close(pv.forward_tokens(x, p), ref, atol=1e-5, rtol=1e-5)


def test_autocast_bf16() -> None:
    pv = PromptedViT(_mini())
    x = _x(pv.vit)
    p = {0: init_prompts(1, 64, 4), 2: torch.randn(3, 1, 64)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pv.forward_tokens(x, p)
    assert out.shape == (3, 19, 64) and torch.isfinite(out).all()
    out.float().sum().backward()
    assert p[0].grad is not None


def test_weight_file_round_trip(tmp_path) -> None:
    vit = _mini(seed=3)
    x = _x(vit)
    torch.save(vit.state_dict(), tmp_path / "m.pt")
    from safetensors.torch import save_file

    save_file(vit.state_dict(), str(tmp_path / "m.safetensors"))
    with torch.no_grad():
        ref = vit(x)
        for name in ("m.pt", "m.safetensors"):
            loaded = build_vit("vit_mini", tmp_path / name).eval()
            torch.testing.assert_close(loaded(x), ref, atol=0, rtol=0)


def test_timm_arch_weight_file(tmp_path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    vit = build_vit("vit_small_patch16_224").eval()
    sd = dict(vit.state_dict())
    sd["head.weight"], sd["head.bias"] = torch.zeros(7, 384), torch.zeros(7)  # in21k files keep a head: dropped
    save_file(sd, str(tmp_path / "s.safetensors"))
    loaded = build_vit("vit_small_patch16_224", tmp_path / "s.safetensors").eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), vit(x), atol=0, rtol=0)
    info = backbone_info(loaded)
    assert info == dict(embed_dim=384, depth=12, img_size=224, patch_size=16, mean=(0.5,) * 3, std=(0.5,) * 3,
                        num_prefix_tokens=1)
    save_file({k: v for k, v in sd.items() if not k.startswith("blocks.11")}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        build_vit("vit_small_patch16_224", tmp_path / "bad.safetensors")


def test_missing_file_and_unknown_arch(tmp_path) -> None:
    missing = tmp_path / "nope.safetensors"
    for arch in ("vit_mini", "vit_base_patch16_224"):
        with pytest.raises(FileNotFoundError, match="nope.safetensors") as e:
            build_vit(arch, missing)
        assert "weights:" in str(e.value) and "backbones.yaml" in str(e.value)
    with pytest.raises(ValueError, match="vit_mini"):
        build_vit("vit_huge")


def test_backbone_info_mini() -> None:
    info = backbone_info(build_vit("vit_mini"))
    assert info == dict(embed_dim=64, depth=4, img_size=16, patch_size=4, mean=ARCHS["vit_mini"]["mean"],
                        std=ARCHS["vit_mini"]["std"], num_prefix_tokens=1)


def test_to_model_input() -> None:
    x = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    out = to_model_input(x, 8, mean, std)
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    ref = (x.permute(0, 3, 1, 2).float() / 255 - m) / s
    assert out.shape == (2, 3, 8, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    up = to_model_input(x, 16, mean, std)
    torch.testing.assert_close(up, F.interpolate(ref, size=(16, 16), mode="bilinear", align_corners=False))
    with pytest.raises(ValueError):
        to_model_input(x.float(), 8, mean, std)


def test_random_shift() -> None:
    x = torch.arange(2 * 6 * 6 * 3, dtype=torch.int64).view(2, 6, 6, 3).to(torch.uint8)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(random_shift(x, 0, g), x)
    out = random_shift(x, 2, g)
    assert out.shape == x.shape and out.dtype == torch.uint8


def _tiny_bundle(n: int = 64) -> DatasetBundle:
    """Random 16x16 images whose label is a bright quadrant: learnable, tiny."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, n)
    x = rng.integers(0, 60, (n, 16, 16, 3)).astype(np.uint8)
    for i, c in enumerate(y):
        r, q = divmod(int(c), 2)
        x[i, 8 * r : 8 * r + 8, 8 * q : 8 * q + 8] += 150
    ds = ArrayDataset(x, y)
    return DatasetBundle(train=ds, test=ds, pretrain=ds, meta=dict(classes=list("abcd")))


def test_pretrain_deterministic(tmp_path) -> None:
    b = _tiny_bundle()
    # one thread: a 2nd one waits on the other core's jobs (20x slower on a busy 2-core machine)
    kw = dict(epochs=1, batch_size=32, lr=1e-3, weight_decay=0.05, seed=5, threads=1, progress=False)
    s1 = pretrain_vit(b, out_path=tmp_path / "a.pt", **kw)
    s2 = pretrain_vit(b, out_path=tmp_path / "b.pt", **kw)
    w1, w2 = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert set(w1) == set(build_vit("vit_mini").state_dict())  # backbone only: no head
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert s1["steps"] == 2 and s1["images_per_s"] > 0 and 0 <= s1["train_acc"] <= 1
    assert s1["train_acc"] == s2["train_acc"]
    pretrain_vit(b, out_path=tmp_path / "c.pt", **{**kw, "seed": 6, "threads": 2})
    assert not all(torch.equal(w1[k], v) for k, v in torch.load(tmp_path / "c.pt").items())
    assert torch.get_num_threads() == 1  # the caller's thread setting (module level: 1) is restored
    build_vit("vit_mini", tmp_path / "a.pt")  # the written file loads through the builder
    assert not list(tmp_path.glob(".*"))  # no temp files left behind
