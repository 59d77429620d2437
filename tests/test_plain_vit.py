"""PlainViT is timm's VisionTransformer at its default settings, bit for bit; training jobs load neither timm
nor torchvision."""
import json
import subprocess
import sys

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from fedcore.backbones.plain_vit import PlainViT, is_vit, trunc_normal_
from fedcore.backbones.prompted import PromptedViT

CONFIGS = [dict(img_size=16, patch_size=4, embed_dim=64, depth=4, num_heads=4),  # vit_mini
           dict(img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2),  # vit_mini_s
           dict(img_size=32, patch_size=8, embed_dim=80, depth=2, num_heads=5, mlp_ratio=2.0)]


@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("num_classes", [0, 7])
def test_same_weights_outputs_and_gradients_as_timm(kw: dict, num_classes: int) -> None:
    torch.manual_seed(3)
    ref = VisionTransformer(**kw, num_classes=num_classes)
    after_ref = torch.rand(4)  # the generator must be left where timm leaves it, too
    torch.manual_seed(3)
    ours = PlainViT(**kw, num_classes=num_classes)
    assert torch.equal(torch.rand(4), after_ref)
    sr, so = ref.state_dict(), ours.state_dict()
    assert list(so) == list(sr)
    assert [k for k in sr if not torch.equal(sr[k], so[k])] == []
    x = torch.randn(5, 3, kw["img_size"], kw["img_size"])
    assert torch.equal(ours(x), ref(x))
    assert torch.equal(ours.forward_features(x), ref.forward_features(x))
    gr = torch.autograd.grad(ref(x).square().sum(), list(ref.parameters()))
    go = torch.autograd.grad(ours(x).square().sum(), list(ours.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(gr, go))


def test_timm_weights_load_and_prompted_outputs_agree() -> None:
    kw = CONFIGS[0]
    ref = VisionTransformer(**kw, num_classes=0)
    ours = PlainViT(**kw)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(3, 3, 16, 16)
    prompts = {0: torch.randn(2, 64), 2: torch.randn(2, 64)}
    for mode in ("insert", "replace"):
        assert torch.equal(PromptedViT(ours)(x, prompts, mode), PromptedViT(ref)(x, prompts, mode))
    assert is_vit(ours) and is_vit(ref) and not is_vit(torch.nn.Linear(2, 2))


def test_grad_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    a = PlainViT(**CONFIGS[1])
    b = PlainViT(**CONFIGS[1])
    b.load_state_dict(a.state_dict())
    b.set_grad_checkpointing(True)
    x = torch.randn(4, 3, 16, 16)
    ga = torch.autograd.grad(a(x).sum(), list(a.parameters()))
    gb = torch.autograd.grad(b(x).sum(), list(b.parameters()))
    assert all(torch.allclose(u, v, atol=1e-6) for u, v in zip(ga, gb))


def test_trunc_normal_is_inverse_cdf_and_truncates() -> None:
    # seeded: about 1 run in 800 draws a uniform of exactly -1 among the 20000 (p = 2^-24 each), whose erfinv is
    # -inf, clamped to a = -2 (timm's method too): that one 100-sigma value alone puts the std near 0.0245
    torch.manual_seed(0)
    t = trunc_normal_(torch.empty(20000), std=1.0, a=-0.5, b=0.5)
    assert t.min() >= -0.5 and t.max() <= 0.5 and t.std() < 0.3  # truncated to a quarter of N(0,1)'s width
    w = trunc_normal_(torch.empty(20000), std=0.02)
    assert abs(float(w.std()) - 0.02) < 0.001


def test_input_size_checked() -> None:
    with pytest.raises(ValueError, match=r"built for \(16, 16\)"):
        PlainViT(**CONFIGS[0])(torch.randn(1, 3, 32, 32))


_PROBE = """
import json, sys, torch
import fedcore.train, fedcore.methods.sgpt, fedcore.methods.fedvpt, fedcore.methods.fedavg
from fedcore.backbones.registry import build_backbone, prompt_adapter
for arch in ("vit_mini", "vit_mini_l", "resnet_mini_18", "resnet_mini_50"):
    m = prompt_adapter(build_backbone(arch))
    m(torch.randn(2, 3, 16, 16)).sum()
print(json.dumps(sorted(k for k in ("timm", "torchvision", "torch._dynamo", "open_clip") if k in sys.modules)))
"""


def test_training_job_imports_neither_timm_nor_torchvision() -> None:
    # what a mini training job loads: timm/torchvision cost ~2.4 s of CPU a job, mostly via torch._dynamo
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []
