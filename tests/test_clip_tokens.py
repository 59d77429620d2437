"""Artifact clip_tokens: the frozen CLIP's CLS + patch tokens per image, built once and loaded with shape checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcore.artifacts import build_artifact, load_artifact
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.backbones.vit import backbone_info
from fedcore.data.arrays import save_bundle
from fedcore.engine.data import InputPipeline
from tests.conftest import synthetic_bundle


def test_clip_tokens_build_and_load(tmp_path) -> None:
    torch.manual_seed(0)
    model = build_backbone("clip_mini")
    torch.save(model.state_dict(), tmp_path / "clip.pt")
    bundle = synthetic_bundle(n_train=12, n_test=5)
    save_bundle(bundle, tmp_path / "data.npz")
    build_artifact("clip_tokens", tmp_path / "data.npz", "clip_mini", tmp_path / "clip.pt", tmp_path / "t.npz",
                   device="cpu")
    train, test = load_artifact("clip_tokens", tmp_path / "t.npz", 12, 5, torch.device("cpu"))
    assert train.shape == (12, 17, 64) and test.shape == (5, 17, 64) and train.dtype == torch.float16
    info = backbone_info(model)
    with torch.no_grad():  # the adapter's tokens of the engine's deterministic input, to float16 precision
        ref = prompt_adapter(model).encode_image_tokens(
            InputPipeline(info["img_size"], info["mean"], info["std"])(torch.from_numpy(bundle.test.x)))
    torch.testing.assert_close(test.float(), ref, atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match=r"train tokens have shape \(12, 17, 64\), expected \(13, 17, 64\)"):
        load_artifact("clip_tokens", tmp_path / "t.npz", 13, 5, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match="features rule"):
        load_artifact("clip_tokens", tmp_path / "missing.npz", 12, 5, torch.device("cpu"))
    np.savez(tmp_path / "other.npz", train=np.zeros(1), test=np.zeros(1), meta='{"format": "x"}')
    with pytest.raises(ValueError, match="not a fedcore-clip-tokens-v1 file"):
        load_artifact("clip_tokens", tmp_path / "other.npz", 1, 1, torch.device("cpu"))


def test_clip_tokens_need_a_clip(tmp_path) -> None:
    save_bundle(synthetic_bundle(n_train=4, n_test=2), tmp_path / "data.npz")
    with pytest.raises(ValueError, match="needs a CLIP backbone"):
        build_artifact("clip_tokens", tmp_path / "data.npz", "vit_mini", None, tmp_path / "t.npz", device="cpu")
