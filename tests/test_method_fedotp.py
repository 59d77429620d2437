"""FedOTP (spec fedotp §1.2-1.12, §9 (d)-(e)): the plan is a constant of the loss, logits batched over classes and
images equal them one by one, the variants, aggregation of the global prompt only (weighted over the round's
clients), local prompts never uplinked, round 1 with every client, Fig. A4's plans, and end-to-end runs."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from otp_helpers import NAMES, build, clip, run, splits  # noqa: F401 (clip, splits: fixtures)
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.roles import FitResult, RoundInfo
from fedcore.methods import method_class
from fedcore.methods.clip_prompt import TOKENS
from fedcore.methods.fedotp import GLOBAL, LOCAL, ot_logits, transport_plans
from fedcore.methods.ot import unbalanced_ot


def _perturbed(method, seed: int = 5):
    """The method's model with global and local prompts moved apart (at init both are near zero)."""
    model = method.model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n in (GLOBAL, LOCAL):
            getattr(model, n).add_(torch.randn(getattr(model, n).shape, generator=g) * 0.5)
    return model


def _differentiable_uot(C, gamma, lam, iters):
    """Algorithm 1 with a fixed iteration count and autograd through it (what detaching T must avoid)."""
    M, N = C.shape[-2:]
    Q = torch.exp(-C / lam)
    u, v = torch.ones(C.shape[:-1]), torch.ones(*C.shape[:-2], N)
    for _ in range(iters):
        u = torch.clamp((1 / M) / (Q * v.unsqueeze(-2)).sum(-1), max=1.0)
        v = (gamma / N) / (Q * u.unsqueeze(-1)).sum(-2)
    return u.unsqueeze(-1) * Q * v.unsqueeze(-2)


def test_the_plan_is_a_constant_of_the_loss(clip, splits):
    train, _ = splits
    method = build("fedotp", clip, n_ctx=4, ot_eps=1e-30, ot_max_iter=20)  # exactly 20 iterations
    model = _perturbed(method)
    tokens, y = train.extras[TOKENS][:8].float(), train.y[:8]

    def grads(loss):
        return torch.autograd.grad(loss, [getattr(model, GLOBAL), getattr(model, LOCAL)])

    ours = grads(F.cross_entropy(model(tokens), y))
    patches = F.normalize(tokens[:, 1:], dim=-1)
    sim = lambda: torch.einsum("bmd,nkd->bkmn", patches, model.text_features())  # noqa: E731 - a fresh graph each
    s = sim()
    const = unbalanced_ot((1 - s).detach(), 0.8, 0.1, eps=1e-30, max_iter=20)
    ref = grads(F.cross_entropy(model.logit_scale * (const * s).sum((-2, -1)), y))
    s = sim()
    plan = _differentiable_uot(1 - s, 0.8, 0.1, 20)
    through = grads(F.cross_entropy(model.logit_scale * (plan * s).sum((-2, -1)), y))
    for a, b, c in zip(ours, ref, through, strict=True):
        assert a.abs().sum() > 0
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)
        assert not torch.allclose(a, c, rtol=1e-2, atol=0)  # autograd through the solver would differ


def test_logits_batched_over_classes_and_images_equal_one_by_one(clip, splits):
    train, _ = splits
    method = build("fedotp", clip, n_ctx=4)
    model = _perturbed(method)
    tokens = train.extras[TOKENS][:6].float()
    with torch.no_grad():
        logits = model(tokens)
        text = model.text_features()
        patches = F.normalize(tokens[:, 1:], dim=-1)
        assert logits.shape == (6, len(NAMES))
        for b in range(6):
            for k in range(len(NAMES)):
                one = ot_logits(patches[b:b + 1], text[:, k:k + 1], model.logit_scale, method.params)
                assert torch.allclose(logits[b, k], one[0, 0], rtol=1e-5, atol=1e-6)


def test_variants_score_as_defined(clip, splits):
    train, _ = splits
    tokens = train.extras[TOKENS][:5].float()
    sim_avg = build("fedotp", clip, n_ctx=4, ot="similarity")
    model = _perturbed(sim_avg)
    with torch.no_grad():
        t = model.text_features()                                              # (2, K, D), normalised
        cls = F.normalize(tokens[:, 0], dim=-1)
        hand = model.logit_scale * 0.5 * (cls @ t[0].T + cls @ t[1].T)        # spec §1.12 [R]
        assert torch.allclose(model(tokens), hand, rtol=1e-5, atol=1e-5)
        classical = build("fedotp", clip, n_ctx=4, ot="classical")
        model = _perturbed(classical)
        plans = transport_plans(classical, model, tokens, train.y[:5])
        assert torch.allclose(plans.sum(-1), torch.full((5, 16), 1 / 16), rtol=1e-3)  # rows equal 1/M
        assert torch.allclose(plans.sum(-2), torch.full((5, 2), 0.5), rtol=1e-6)     # columns 1/N
    with pytest.raises(ValueError, match="transports nothing"):
        transport_plans(sim_avg, sim_avg.model, tokens, train.y[:5])


def test_transport_plans_are_the_true_class_plans_of_the_logits(clip, splits):
    train, _ = splits
    method = build("fedotp", clip, n_ctx=4, ot_gamma=0.5)
    model = _perturbed(method)
    tokens, y = train.extras[TOKENS][:7].float(), train.y[:7]
    plans = transport_plans(method, model, tokens, y)
    assert plans.shape == (7, 16, 2) and plans.dtype == torch.float32
    assert torch.allclose(plans.sum(1), torch.full((7, 2), 0.25), rtol=1e-6)      # gamma / N per prompt
    with torch.no_grad():
        patches = F.normalize(tokens[:, 1:], dim=-1)
        sim = torch.einsum("bmd,nbd->bmn", patches, model.text_features()[:, y])
        assert torch.allclose(model.logit_scale * (plans * sim).sum((1, 2)), model(tokens)[torch.arange(7), y],
                              rtol=1e-5)


def test_aggregation_averages_only_the_global_prompt_over_the_rounds_clients(clip):
    method = build("fedotp", clip, n_ctx=4)
    server = method.strategy.init_state(3)
    assert set(server["model"]) == {GLOBAL}
    g = torch.Generator().manual_seed(0)
    ups = {c: torch.randn(4, 32, generator=g) for c in (0, 2)}
    results = [FitResult(0, 10, {"model": {GLOBAL: ups[0]}}, {}), FitResult(2, 30, {"model": {GLOBAL: ups[2]}}, {})]
    new = method.strategy.aggregate(RoundInfo(2, 3, 0.67, 0), server, results)
    assert set(new["model"]) == {GLOBAL}
    assert torch.allclose(new["model"][GLOBAL], 0.25 * ups[0] + 0.75 * ups[2], rtol=1e-6, atol=1e-7)
    keys = method.keys(0)
    assert method.client.shared_keys(keys) == [GLOBAL] and method.client.personal_keys(keys) == [LOCAL]


def test_round_one_trains_every_client_then_the_fraction(clip):
    for round0_all, first in ((True, 4), (False, 2)):
        method = build("fedotp", clip, n_ctx=4, round0_all=round0_all)
        sizes = [len(method.strategy.select(RoundInfo(r, 4, 0.5, 0), {})) for r in (1, 2, 3)]
        assert sizes == [first, 2, 2]


def test_end_to_end_local_prompts_stay_home(clip, splits, monkeypatch):
    train, test = splits
    method = build("fedotp", clip, n_ctx=4)
    uplinks = []
    real = method.strategy.aggregate

    def spy(info, state, results):
        uplinks.append((info.round, results))
        return real(info, state, results)

    monkeypatch.setattr(method.strategy, "aggregate", spy)
    res = run(method, train, test, clients=3, rounds=2, participation=0.34, lr=0.05)
    assert [sorted(r.cid for r in rs) for _, rs in uplinks][0] == [0, 1, 2]   # round 1: every client
    assert len(uplinks[1][1]) == 1
    locals_ = {c: s["model"][LOCAL] for c, s in res.client_states.items()}
    assert set(res.client_states) == {0, 1, 2} and all(set(s["model"]) == {LOCAL} for s in res.client_states.values())
    init = method.initial_state(0, [GLOBAL, LOCAL])
    for _, results in uplinks:
        for r in results:
            assert set(r.uplink) == {"model"} and set(r.uplink["model"]) == {GLOBAL}
            assert not any(torch.equal(r.uplink["model"][GLOBAL], loc) for loc in locals_.values())
    # the server's prompt is the size-weighted mean of round 2's only uplink; each client trained its own local one
    assert torch.equal(res.server_state["model"][GLOBAL], uplinks[1][1][0].uplink["model"][GLOBAL])
    assert all(not torch.equal(loc, init[LOCAL]) for loc in locals_.values())
    assert not torch.equal(locals_[0], locals_[1])
    df = res.metrics
    assert len(df[(df["round"] == 2) & (df.split == "local") & (df.metric == "acc") & (df.client >= 0)]) == 3
    assert df[(df.metric == "loss") & (df.client == -1)]["value"].notna().all()
    assert df[(df.metric == "upload_numbers_total")]["value"].tolist() == [3 * 4 * 32, 4 * 32]


def test_bad_settings_are_refused_before_any_work(clip):
    with pytest.raises(ValueError, match=r"ot.*one of"):
        build("fedotp", clip, ot="sinkhorn")
    with pytest.raises(ValueError, match="ot_gamma"):
        build("fedotp", clip, ot_gamma=0.0)
    with pytest.raises(ValueError, match="unknown key"):
        build("fedotp", clip, gamma=0.8)
    with pytest.raises(ValueError, match="class_names"):
        method_class("fedotp")(clip, 4, {})
    with pytest.raises(ValueError, match="3 class names for 4 classes"):
        method_class("fedotp")(clip, 4, {}, class_names=NAMES[:3])
    with pytest.raises(ValueError, match="needs a CLIP backbone"):
        build("fedotp", prompt_adapter(build_backbone("vit_mini")))
