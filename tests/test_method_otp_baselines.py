"""FedOTP's baselines (spec fedotp §4, §8.3, §8.15): zero-shot CLIP against a hand computation (and the engine
running a method with nothing trainable), PromptFL + FedProx's proximal gradient, CoOp's no-communication local training,
PromptFL's FedAvg of one global prompt, and one run through train_run with the clip_tokens artifact."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch.nn import functional as F

from conftest import identity, run_params, synthetic_bundle
from otp_helpers import NAMES, build, clip, run, splits  # noqa: F401 (clip, splits: fixtures)
from fedcore.artifacts import build_artifact
from fedcore.backbones.clip import clip_classnames
from fedcore.backbones.registry import build_backbone
from fedcore.data.arrays import save_bundle
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.methods.clip_prompt import TOKENS
from fedcore.partition.make import make_partition
from fedcore.train import train_run


def test_zero_shot_clip_equals_a_hand_computation_and_trains_nothing(clip, splits):
    train, test = splits
    method = build("zs_clip", clip)
    assert method.trainable_keys(0) == [] and method.keys(0) == []
    with torch.no_grad():
        text = F.normalize(clip.encode_text([f"a photo of a {n}." for n in NAMES]), dim=-1)
        cls = F.normalize(test.extras[TOKENS][:, 0].float(), dim=-1)
        hand = clip.logit_scale * cls @ text.T
        assert torch.allclose(method.model(test.extras[TOKENS].float()), hand, rtol=1e-5, atol=1e-5)
    # the engine's default update with nothing trainable: no pass over the data, no optimiser, loss NaN
    untouched = ClientData(0, 5, lambda: pytest.fail("a model with nothing trainable read its data"),
                           torch.Generator(), None)
    stats, opt = method.client.train(method.model, 0, {}, {}, untouched, TrainSettings(1, 8, {"name": "sgd"}))
    assert opt is None and stats["loss"] != stats["loss"]
    res = run(method, train, test, clients=2, rounds=1)
    df = res.metrics.set_index(["client", "split", "metric"])["value"]
    pred = hand.argmax(1)
    for c, idx in enumerate(torch.arange(len(test.y)).chunk(2)):
        assert df[(c, "local", "acc")] == pytest.approx(float((pred[idx] == test.y[idx]).float().mean()))
    assert df[(-1, "train", "upload_numbers_total")] == 0 and res.server_state == {"model": {}}


def test_fedprox_term_reaches_the_prompt_gradient(clip, splits):
    train, _ = splits
    tokens, y = train.extras[TOKENS][:8], train.y[:8]
    batch = lambda: iter([_batch(tokens, y)])  # noqa: E731 - one batch per epoch
    settings = TrainSettings(2, 8, {"name": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0})
    after = {}
    for mu in (0.0, 0.5):
        method = build("promptfl_fedprox", clip, n_ctx=4, mu=mu)
        model = method.model
        start = model.ctx.detach().clone()
        data = ClientData(0, 8, batch, torch.Generator(), settings)
        method.client.train(model, 0, {}, {"model": {"ctx": start}}, data, settings)  # 2 epochs of one batch
        after[mu] = model.ctx.detach().clone()
    # by hand: P1 = P0 - g(P0) (the term is 0 at its anchor), P2 = P1 - g(P1) - mu (P1 - P0)
    method = build("promptfl_fedprox", clip, n_ctx=4)
    model = method.model
    p0 = model.ctx.detach().clone()

    def ce_grad(p):
        with torch.no_grad():
            model.ctx.copy_(p)
        return torch.autograd.grad(F.cross_entropy(model(tokens.float()), y), model.ctx)[0]

    p1 = p0 - ce_grad(p0)
    p2 = p1 - ce_grad(p1) - 0.5 * (p1 - p0)
    assert torch.allclose(after[0.5], p2, rtol=1e-5, atol=1e-7)
    assert torch.allclose(after[0.0], p1 - ce_grad(p1), rtol=1e-5, atol=1e-7)
    assert (after[0.5] - after[0.0]).abs().max() > 1e-4 * (p1 - p0).abs().max()


def _batch(tokens, y):
    from fedcore.engine.data import Batch

    return Batch(torch.zeros(len(y), 3, 16, 16), y, torch.arange(len(y)), {TOKENS: tokens})


def test_coop_trains_every_client_alone_and_sends_nothing(clip, splits):
    train, test = splits
    method = build("coop", clip, n_ctx=4)
    init = method.initial_state(0, ["ctx"])["ctx"]
    res = run(method, train, test, clients=2, rounds=2, participation=0.5, lr=0.05)
    df = res.metrics
    assert (df[df.metric == "upload_numbers"]["value"] == 0).all()
    assert len(df[(df.metric == "loss") & (df.client >= 0)]) == 4          # both clients, both rounds
    assert res.server_state["model"] == {}
    ctx = [res.client_states[c]["model"]["ctx"] for c in (0, 1)]
    assert not torch.equal(ctx[0], ctx[1]) and not torch.equal(ctx[0], init)
    assert method.evaluator.personalized


def test_promptfl_averages_one_global_prompt_and_scores_it_everywhere(clip, splits):
    train, test = splits
    method = build("promptfl", clip, n_ctx=4)
    ups = []
    real = method.strategy.aggregate
    method.strategy.aggregate = lambda info, state, results: (ups.append(results), real(info, state, results))[1]
    res = run(method, train, test, clients=2, rounds=1, lr=0.05)
    (a, b), = ups
    want = (a.num_samples * a.uplink["model"]["ctx"] + b.num_samples * b.uplink["model"]["ctx"]) / (a.num_samples
                                                                                                 + b.num_samples)
    assert torch.allclose(res.server_state["model"]["ctx"], want, rtol=1e-6, atol=1e-8)
    assert all(s["model"] == {} for s in res.client_states.values()) and not method.evaluator.personalized


def test_train_run_reads_the_clip_tokens_artifact_and_the_class_names(tmp_path):
    torch.manual_seed(0)
    torch.save(build_backbone("clip_mini").state_dict(), tmp_path / "clip.pt")
    bundle = synthetic_bundle(n_train=24, n_test=12)
    save_bundle(bundle, tmp_path / "data.npz")
    make_partition({"scheme": "iid", "clients": 2}, 0, bundle.train.y, bundle.test.y).save(tmp_path / "part.npz")
    build_artifact("clip_tokens", tmp_path / "data.npz", "clip_mini", tmp_path / "clip.pt", tmp_path / "tok.npz",
                   device="cpu")
    params = {**run_params(rounds=1, participation=1.0), "paper": "fedotp",
              "method_params": {"n_ctx": 2}}
    common = dict(dataset_path=tmp_path / "data.npz", partition_path=tmp_path / "part.npz",
                  backbone_arch="clip_mini", backbone_weights=tmp_path / "clip.pt", device="cpu", progress=False)
    with pytest.raises(ValueError, match=r"per-sample artifacts \['clip_tokens'\]"):
        train_run(params, identity("fedotp"), metrics_out=tmp_path / "m.parquet", final_out=tmp_path / "f.pt",
                  **common)
    train_run(params, identity("fedotp"), metrics_out=tmp_path / "m.parquet", final_out=tmp_path / "f.pt",
              artifacts={TOKENS: tmp_path / "tok.npz"}, **common)
    df = pd.read_parquet(tmp_path / "m.parquet")
    assert set(df[(df.split == "local") & (df.metric == "acc")]["client"]) == {0, 1}
    final = torch.load(tmp_path / "f.pt", weights_only=False)
    assert set(final["global"]) == {"ctx_global"} and set(final["personal"]) == {0, 1}
    assert all(set(s) == {"ctx_local"} for s in final["personal"].values())


def test_the_class_name_order_flag_reaches_the_prompts(tmp_path, monkeypatch):
    """A partition made with bug_compat_classname_order carries a class order; the run's prompts name the classes
    in that order (the official code's set order), not silently in label order."""
    import numpy as np

    from fedcore.engine import roles

    torch.manual_seed(0)
    torch.save(build_backbone("clip_mini").state_dict(), tmp_path / "clip.pt")
    bundle = synthetic_bundle(n_train=24, n_test=12)
    save_bundle(bundle, tmp_path / "data.npz")
    part = make_partition({"scheme": "iid", "clients": 2}, 0, bundle.train.y, bundle.test.y)
    order = np.roll(np.arange(bundle.num_classes), 1)
    part.class_order = order
    part.save(tmp_path / "part.npz")
    build_artifact("clip_tokens", tmp_path / "data.npz", "clip_mini", tmp_path / "clip.pt", tmp_path / "tok.npz",
                   device="cpu")
    seen = {}
    init = roles.Method.__init__

    def spy(self, *args, **kwargs):
        seen["names"] = kwargs.get("class_names")
        init(self, *args, **kwargs)

    monkeypatch.setattr(roles.Method, "__init__", spy)
    train_run({**run_params(rounds=1, participation=1.0), "paper": "fedotp"}, identity("zs_clip"),
              tmp_path / "data.npz", tmp_path / "part.npz", "clip_mini", tmp_path / "clip.pt", tmp_path / "m.parquet",
              tmp_path / "f.pt", device="cpu", progress=False, artifacts={TOKENS: tmp_path / "tok.npz"})
    names = clip_classnames(bundle.meta)
    assert seen["names"] == [names[int(j)] for j in order] != names
