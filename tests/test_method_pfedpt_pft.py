"""pFedPT on the experiment's backbone (``arch: experiment``, FedPFT's baseline): the border prompt in front of the
entire extractor, sized by the experiment's input, the two stages, what leaves a client, and 2-round runs on a
scratch ResNet-8 twin and a tiny ResNet-18."""
from __future__ import annotations

import pytest
import torch

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.roles import Strategy
from fedcore.methods.pfedpt import PadPrompt, PFedPT, PromptedWholeModel
from fedcore.train import train_run

C = 4


def _method(arch: str = "resnet8_pft_mini", **params) -> PFedPT:
    torch.manual_seed(0)
    return PFedPT(prompt_adapter(build_backbone(arch)), C, {"arch": "experiment", "pad_width": 2, **params})


def test_the_prompt_pads_the_experiments_input_in_front_of_the_whole_extractor():
    assert PFedPT.own_backbone({**PFedPT.defaults, "arch": "experiment"}) is None
    assert PFedPT.own_backbone(dict(PFedPT.defaults)) == "vit_pfedpt"        # FedHPL's setting is unchanged
    PFedPT.check_params({**PFedPT.defaults, "arch": "experiment", "pad_width": 2})
    method = _method()
    model = method.model
    assert isinstance(model, PromptedWholeModel) and isinstance(model.prompt, PadPrompt)
    assert (model.prompt.size, model.prompt.width) == (16, 2)
    assert all(p.requires_grad for p in model.net.parameters())
    assert model.head.in_features == 64 and model.head.out_features == C
    keys = method.keys(0)
    assert method.client.personal_keys(keys) == [k for k in keys if k.startswith("prompt.")]
    shared = method.client.shared_keys(keys)
    assert "net.bn1.running_mean" in shared and "head.weight" in shared and not any("prompt" in k for k in shared)
    x = torch.randn(2, 3, 16, 16)
    model.eval()
    assert torch.allclose(model(x), model.head(model.net(model.prompt(x))))
    assert torch.allclose(model.prompt(x) - x, model.prompt.frame().expand_as(x))
    with pytest.raises(ValueError, match="pad_width"):
        _method(pad_width=8)                                                # no image left inside 16 px


def _run(files, out, arch: str):
    out.mkdir(exist_ok=True)
    params = {**run_params(rounds=2, participation=1.0),
              "method_params": {"arch": "experiment", "pad_width": 2, "prompt_epochs": 1}}
    return train_run(params, identity("pfedpt"), files["dataset"], files["partition5"], arch,
                     files["weights"].get(arch), out / "m.parquet", out / "f.pt", progress=False)


@pytest.mark.parametrize("arch", ["resnet8_pft_mini", "resnet_mini_18"])
def test_two_rounds_send_the_extractor_and_head_and_keep_the_prompts(hetero_files, tmp_path, monkeypatch, arch):
    uplinks = []
    original = Strategy.aggregate
    monkeypatch.setattr(Strategy, "aggregate", lambda self, info, state, results: uplinks.extend(
        set(r.uplink["model"]) for r in results) or original(self, info, state, results))
    res = _run(hetero_files, tmp_path / arch, arch)
    assert len(uplinks) == 10 and all(u and not any(k.startswith("prompt.") for k in u) for u in uplinks)
    assert res.global_state["net.bn1.running_mean"].abs().sum() > 0        # BatchNorm trained, averaged
    prompts = [res.personal_states[c]["prompt.top"] for c in range(5)]
    assert all(not torch.equal(prompts[0], p) for p in prompts[1:])
    m = res.metrics
    acc = m[(m["round"] == 2) & (m.split == "local") & (m.metric == "acc")]
    assert len(acc) == 5 and acc["value"].between(0, 1).all()
