"""The CLIP prompt adapter (fedcore.backbones.clip.PromptedCLIP) against open_clip's own encoders."""
from __future__ import annotations

import open_clip
import pytest
import torch
import torch.nn.functional as F

from fedcore.backbones.clip import PromptedCLIP, tokenize
from fedcore.backbones.registry import prompt_adapter

torch.set_num_threads(1)
# random-init tiny CLIP; the full BPE vocabulary (49408) because the real tokenizer feeds it
TINY = dict(embed_dim=24, vision_cfg=dict(image_size=16, layers=2, width=32, patch_size=4, head_width=16),
            text_cfg=dict(context_length=20, vocab_size=49408, width=32, heads=2, layers=2))


@pytest.fixture(scope="module")
def clip() -> open_clip.CLIP:
    torch.manual_seed(0)
    model = open_clip.CLIP(**TINY).eval()
    with torch.no_grad():  # larger than open_clip's init: a context put at the wrong positions shows
        model.positional_embedding.normal_(std=0.1)
    return model


@pytest.fixture(scope="module")
def adapter(clip) -> PromptedCLIP:
    return prompt_adapter(clip)


def _words_ctx(adapter: PromptedCLIP, words: str) -> torch.Tensor:
    """(n, text_width) token embeddings of `words` (one token each): a context equal to real text."""
    ids = tokenize([words], adapter.context_length)[0]
    n = int(ids.argmax()) - 1
    return adapter.token_embedding(ids[1 : 1 + n])


def test_static_facts(adapter) -> None:
    assert (adapter.embed_dim, adapter.feature_dim, adapter.text_width) == (24, 24, 32)
    assert (adapter.context_length, adapter.num_patches, adapter.img_size, adapter.patch_size) == (20, 16, 16, 4)
    assert adapter.logit_scale == pytest.approx(1 / 0.07)  # open_clip's init: exp(log(1/0.07))


def test_image_tokens_match_open_clip(clip, adapter) -> None:
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = adapter.encode_image_tokens(x)
        ref = clip.encode_image(x)
        v = clip.visual  # every token after ln_post and @ proj (what FedOTP's modified CLIP returns)
        manual = v.ln_post(v.transformer(v._embeds(x))) @ v.proj
    assert tokens.shape == (3, 1 + 16, 24) and tokens.dtype == torch.float32
    cos = F.cosine_similarity(tokens[:, 0], ref, dim=-1)
    torch.testing.assert_close(cos, torch.ones(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(tokens, manual, atol=1e-5, rtol=1e-5)
    assert not clip.visual.output_tokens  # the wrapped model's own encode_image is left as it was


def test_context_of_real_words_equals_encode_text(clip, adapter) -> None:
    ids, eot = adapter.tokenize_classnames(["seven", "ice_cream"], n_ctx=4)
    assert torch.equal(eot, ids.argmax(-1))
    ctx = torch.stack([_words_ctx(adapter, "a photo of the"), _words_ctx(adapter, "an image of one")])
    with torch.no_grad():
        feats = adapter.encode_text_with_context(ctx, ids, eot)
        ref = clip.encode_text(tokenize([f"{w} {c}." for w in ("a photo of the", "an image of one")
                                         for c in ("seven", "ice cream")], 20))
        ours_text = adapter.encode_text(["a photo of the seven."])
    assert feats.shape == (2, 2, 24)
    torch.testing.assert_close(feats.reshape(4, 24), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_text[0], ref[0], atol=1e-5, rtol=1e-5)


def test_gradient_reaches_ctx_only(adapter) -> None:
    ids, eot = adapter.tokenize_classnames(["zero", "one", "two"], n_ctx=3)
    ctx = torch.nn.Parameter(torch.randn(2, 3, 32) * 0.02)
    adapter.train()
    adapter.encode_text_with_context(ctx, ids, eot).square().sum().backward()
    assert ctx.grad is not None and ctx.grad.abs().sum() > 0 and ctx.grad.abs().amin(dim=-1).gt(0).all()
    assert all(p.grad is None and not p.requires_grad for p in adapter.parameters())


def test_batched_prompts_equal_one_at_a_time(adapter) -> None:
    ids, eot = adapter.tokenize_classnames(["zero", "one hundred and one", "big_cat"], n_ctx=5)
    ctx = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batched = adapter.encode_text_with_context(ctx, ids, eot)
        single = torch.stack([torch.cat([adapter.encode_text_with_context(ctx[p : p + 1], ids[k : k + 1],
                                                                          eot[k : k + 1])[0]
                                         for k in range(3)]) for p in range(3)])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(batched[0], batched[1])  # the contexts matter


def test_frozen_and_eval_after_train(clip) -> None:
    adapter = PromptedCLIP(clip)
    adapter.train()
    assert adapter.training and not clip.training and not any(m.training for m in clip.modules())
    assert not any(p.requires_grad for p in clip.parameters())


def test_bad_inputs_are_named(adapter) -> None:
    with pytest.raises(ValueError, match="do not fit.*20 tokens"):
        adapter.tokenize_classnames(["a very long class name " * 3], n_ctx=4)
    ids, eot = adapter.tokenize_classnames(["one"], n_ctx=2)
    with pytest.raises(ValueError, match="ctx must be"):
        adapter.encode_text_with_context(torch.zeros(2, 16), ids, eot)
    small = open_clip.CLIP(**{**TINY, "text_cfg": {**TINY["text_cfg"], "vocab_size": 64}})
    with pytest.raises(ValueError, match="vocabulary has 64"):
        PromptedCLIP(small).tokenize_classnames(["one"], n_ctx=2)


def test_paper_clip_shapes_and_quickgelu() -> None:
    from fedcore.backbones.registry import build_backbone

    from fedcore.backbones.registry import CLIP_NORM
    from fedcore.backbones.vit import backbone_info

    with torch.device("meta"):  # ViT-B/16's real shapes without allocating them
        model = build_backbone("clip_vit_b16")
        adapter = prompt_adapter(model)
    info = backbone_info(model)  # the input contract of the openai tag
    assert (info["img_size"], info["mean"], info["std"], info["family"]) == (224, *CLIP_NORM.values(), "clip")
    assert (adapter.embed_dim, adapter.text_width, adapter.context_length) == (512, 512, 77)
    assert (adapter.num_patches, adapter.img_size, adapter.patch_size) == (196, 224, 16)
    acts = {type(m).__name__ for m in adapter.clip.modules() if "GELU" in type(m).__name__}
    assert acts == {"QuickGELU"}  # OpenAI's weights were trained with it (spec fedotp §1.1)


def test_open_clip_weight_file_through_our_builder(tmp_path) -> None:
    """A safetensors file of a random CLIP loads through _build_open_clip as clip_vit_b16 builds (a named open_clip
    config + force_quick_gelu), at a tiny config's shapes; without QuickGELU the same file gives other features."""
    import json
    from dataclasses import replace

    from safetensors.torch import save_file

    from fedcore.backbones import registry as reg

    cfg_file = tmp_path / "fedcore-test-clip-b16-like.json"
    cfg_file.write_text(json.dumps(TINY))
    open_clip.add_model_config(cfg_file)  # open_clip's own registry, offline
    spec = replace(reg.ARCH_SPECS["clip_vit_b16"], builder="fedcore-test-clip-b16-like", depth=2, dim=24, patch_size=4)
    specs, cfgs = dict(reg.ARCH_SPECS), dict(reg.PRETRAINED_CFGS)
    try:
        reg.register_arch("clip_b16_like", spec, {"openai": reg.PretrainedCfg(16, **reg.CLIP_NORM)})
        torch.manual_seed(0)
        src = open_clip.create_model("fedcore-test-clip-b16-like", force_quick_gelu=True).eval()
        save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "w.safetensors"))
        model = reg.build_backbone("clip_b16_like", tmp_path / "w.safetensors")
        x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            ref_img, ref_txt = src.encode_image(x), src.encode_text(tokenize(["a photo of a seven."], 20))
            adapter = prompt_adapter(model)
            torch.testing.assert_close(adapter.encode_image_tokens(x)[:, 0], ref_img, atol=0, rtol=0)
            torch.testing.assert_close(adapter.encode_text(["a photo of a seven."]), ref_txt, atol=1e-6, rtol=1e-6)
            gelu = open_clip.create_model("fedcore-test-clip-b16-like").eval()
            open_clip.load_checkpoint(gelu, str(tmp_path / "w.safetensors"))
            assert not torch.allclose(gelu.encode_image(x), ref_img, atol=1e-4)
    finally:
        reg.ARCH_SPECS.clear()
        reg.ARCH_SPECS.update(specs)
        reg.PRETRAINED_CFGS.clear()
        reg.PRETRAINED_CFGS.update(cfgs)

