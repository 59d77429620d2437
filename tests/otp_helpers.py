"""Shared by the FedOTP method tests: a random-init tiny CLIP, in-memory image tokens and a run through the engine."""
from __future__ import annotations

import open_clip
import pytest
import torch

from conftest import identity, synthetic_bundle
from fedcore.backbones.registry import prompt_adapter
from fedcore.engine.data import DeviceSplit, InputPipeline
from fedcore.engine.evaluate import EvalSets
from fedcore.engine.loop import RunResult, RunSpec, run_federated
from fedcore.engine.roles import Method
from fedcore.methods import method_class
from fedcore.methods.clip_prompt import TOKENS

# one block per tower: M = 16 patches of 4 px, joint dim 24, text width 32; the real BPE vocabulary
TINY = dict(embed_dim=24, vision_cfg=dict(image_size=16, layers=1, width=32, patch_size=4, head_width=16),
            text_cfg=dict(context_length=20, vocab_size=49408, width=32, heads=2, layers=1))
NAMES = ["zero", "one", "two", "three"]   # the synthetic bundle's 4 classes, as a text prompt names them
PIPELINE = InputPipeline(16, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def tiny_clip(seed: int = 0) -> torch.nn.Module:
    """The frozen PromptedCLIP around a random-init tiny open_clip CLIP."""
    torch.manual_seed(seed)
    return prompt_adapter(open_clip.CLIP(**TINY))


def token_splits(clip: torch.nn.Module, n_train: int = 48, n_test: int = 24) -> tuple[DeviceSplit, DeviceSplit]:
    """Train and test splits of the synthetic bundle carrying their image tokens (float16, as the artifact)."""
    bundle = synthetic_bundle(n_train=n_train, n_test=n_test)
    out = []
    for ds in (bundle.train, bundle.test):
        split = DeviceSplit.from_arrays(ds, torch.device("cpu"))
        with torch.no_grad():
            split.extras[TOKENS] = clip.encode_image_tokens(PIPELINE(split.x)).half()
        out.append(split)
    return out[0], out[1]


def build(name: str, clip: torch.nn.Module, seed: int = 1, **params) -> Method:
    """Method ``name`` over ``clip`` with the tiny run's class names (the model's init drawn from ``seed``)."""
    torch.manual_seed(seed)
    return method_class(name)(clip, len(NAMES), params, class_names=NAMES)


def run(method: Method, train: DeviceSplit, test: DeviceSplit, clients: int = 2, rounds: int = 2,
        participation: float = 1.0, lr: float = 1e-3, seed: int = 0) -> RunResult:
    """``rounds`` rounds of ``method`` on ``clients`` contiguous IID shards, through the engine's loop."""
    ctr = list(torch.arange(len(train.y)).chunk(clients))
    cte = list(torch.arange(len(test.y)).chunk(clients))
    spec = RunSpec(identity={**identity(method.name, seed), "paper": "fedotp"},
                   federation=dict(rounds=rounds, participation=participation, local_epochs=1, batch_size=8),
                   optimizer=dict(name="sgd", lr=lr, momentum=0.9, weight_decay=5e-4))
    return run_federated(method, train, test, ctr, EvalSets(test, cte, None, "pooled_local"), PIPELINE, spec,
                         progress=False)


# Module-scoped fixtures the FedOTP test files import (each importing module gets its own instance).
@pytest.fixture(scope="module")
def clip() -> torch.nn.Module:
    """A tiny random-init CLIP adapter."""
    return tiny_clip()


@pytest.fixture(scope="module")
def splits(clip: torch.nn.Module) -> tuple[DeviceSplit, DeviceSplit]:
    """Train and test splits carrying the tiny CLIP's image tokens."""
    return token_splits(clip)
