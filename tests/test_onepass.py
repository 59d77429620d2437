"""One pass (fedcore/engine/onepass.py) equals one by one, per method family: a round's clients trained together
through ``Client.together`` give every client the state, uplink, optimiser state and stats of its own ``fit``.

fp32 on the CPU, compared bit for bit (``torch.equal``): every operation a client's numbers go through has the shapes
of its one-by-one update except the frozen backbone's, whose CPU kernels give each row the same arithmetic whatever
the batch. Clients of uneven sizes (1, 3 and 2 batches an epoch, short last batches), 2 local epochs, different
starting tensors where a client keeps any.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor

from fedcore.backbones.prompted import PromptedViT, attention_backend
from fedcore.backbones.vit import build_vit
from fedcore.engine.batching import ONE_PASS_ON
from fedcore.engine.data import Batch
from fedcore.engine.onepass import Owners, concat_batches, train_one_pass
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, Method
from fedcore.methods import method_class
from fedcore.methods.clip_prompt import TOKENS
from fedcore.methods.sgpt import QUERY
from otp_helpers import NAMES, tiny_clip

SIZES = (4, 11, 6)  # batches of 4: 1, 3 (the last of 3) and 2 (the last of 2) an epoch
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}
ADAM = {"name": "adam", "lr": 0.01, "weight_decay": 1e-3}
CLASSES = 4


def _vit_method(name: str, **params: Any) -> Method:
    torch.manual_seed(0)
    return method_class(name)(PromptedViT(build_vit("vit_mini")), CLASSES, params)


def _data(cid: int, n: int, x_shape: tuple[int, ...], extras: dict[str, tuple[int, ...]],
          settings: TrainSettings) -> ClientData:
    """Client ``cid``'s ``n`` samples, shuffled each epoch by its own generator (as the engine's batches)."""
    g = torch.Generator().manual_seed(10 + cid)
    x, y = torch.randn(n, *x_shape, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    ex = {k: torch.randn(n, *shape, generator=g) for k, shape in extras.items()}
    gen = torch.Generator().manual_seed(20 + cid)

    def batches():
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, settings.batch_size):
            idx = order[i:i + settings.batch_size]
            yield Batch(x[idx], y[idx], idx, {k: v[idx] for k, v in ex.items()})

    return ClientData(cid, n, batches, gen, settings)


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    """Nested payloads equal bit for bit (tensors), or exactly (numbers, NaN = NaN)."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_same(u, v, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def _round(method: Method, server: dict, states: list[dict], settings: TrainSettings, x_shape: tuple[int, ...],
           extras: dict[str, tuple[int, ...]] | None = None) -> list[tuple[dict, FitResult]]:
    """One round of the clients trained together and one by one, compared; the round's outcomes."""
    client, model = method.client, method.model
    plan = client.together("cpu", model)
    assert plan.fit is not None and "one pass" in plan.how, plan.why_not
    downs = [method.strategy.configure(server, c) for c in range(len(states))]
    datas = [_data(c, n, x_shape, extras or {}, settings) for c, n in enumerate(SIZES)]
    with attention_backend("cpu"):
        model.train()
        together = plan.fit(copy.deepcopy(states), downs, datas, settings)
        alone = []
        for c, n in enumerate(SIZES):
            model.train()
            alone.append(client.fit(c, copy.deepcopy(states[c]), downs[c],
                                    _data(c, n, x_shape, extras or {}, settings), settings))
    for c, ((sa, ra), (sb, rb)) in enumerate(zip(together, alone, strict=True)):
        _assert_same(sa, sb, f"client {c} state")
        _assert_same(ra.uplink, rb.uplink, f"client {c} uplink")
        _assert_same(ra.stats, rb.stats, f"client {c} stats")
        assert (ra.cid, ra.num_samples) == (rb.cid, rb.num_samples)
    return alone


def _states(method: Method, perturb: bool = True) -> list[dict]:
    """Each client's initial state, its personal tensors moved apart (so a mixed-up row would show)."""
    states = [method.client.init_state(c) for c in range(len(SIZES))]
    if perturb:
        g = torch.Generator().manual_seed(5)
        for st in states:
            st["model"] = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                           for k, v in st["model"].items()}
    return states


@pytest.mark.parametrize("name", ["fedvpt", "fedvpt_d", "local"])
def test_prompt_and_head_methods(name):
    """FedVPT (shallow prompts), FedVPT-D (deep) and Local (personal prompts + head) with SGD."""
    method = _vit_method(name)
    server = method.strategy.init_state(len(SIZES))
    _round(method, server, _states(method), TrainSettings(2, 4, SGD), (3, 16, 16))


def test_pfedpg_generated_prompts_and_own_epochs():
    """pFedPG: each client's own generated prompts, personal heads; its ``local_epochs`` (3) in one pass too."""
    method = _vit_method("pfedpg", local_epochs=3)
    _round(method, method.strategy.init_state(len(SIZES)), _states(method), TrainSettings(1, 4, SGD), (3, 16, 16))


def test_fedpr_projects_each_clients_step():
    """FedPR: every step of a protected prompt projected onto the null space of the downlink's global prompts."""
    method = _vit_method("fedpr")
    server = method.strategy.init_state(len(SIZES))
    g = torch.Generator().manual_seed(1)
    ups = [FitResult(c, 3, {"model": {k: v + torch.randn(v.shape, generator=g) for k, v in server["model"].items()}},
                     {}) for c in range(2)]
    server = method.strategy.aggregate(None, server, ups)
    assert any(b.shape[1] > 0 for b in server["fedpr_basis"].values())
    _round(method, server, _states(method, perturb=False), TrainSettings(2, 4, SGD), (3, 16, 16))


@pytest.mark.parametrize("params", [{}, {"batch_vote": True, "schedule": "joint"}], ids=["bcd", "vote_joint"])
def test_sgpt_blocks_per_sample_groups_and_counts(params):
    """SGPT: both blocks, Select per sample with each client's own keys and the downlink's calibration, the
    selection counts of its uplink; the feature-shift variant (the batch's vote) and the joint schedule."""
    method = _vit_method("sgpt", groups=5, shared_blocks=[0, 2], group_blocks=[1, 2], select_block=3, **params)
    server = method.strategy.init_state(len(SIZES))
    server["v"] = torch.tensor([3.0, 0.0, 7.0, 1.0, 2.0], dtype=torch.float64)
    alone = _round(method, server, _states(method, perturb=False), TrainSettings(2, 4, SGD), (3, 16, 16),
                   {QUERY: (64,)})
    assert all(float(r.uplink["select_counts"].sum()) > 0 for _, r in alone)


def test_head_tune_on_cached_features():
    """Head-Tune: each client's head on the cached features, Adam."""
    method = _vit_method("head_tune")
    _round(method, method.strategy.init_state(len(SIZES)), _states(method, perturb=False),
           TrainSettings(2, 4, ADAM), (64,))


@pytest.mark.parametrize("opt", [SGD, ADAM], ids=["sgd", "adam"])
def test_fedhpl_teachers_and_kept_optimisers_over_two_rounds(opt):
    """FedHPL (deep prompts): each client its own teacher logits; its optimiser kept across rounds (spec §1.7), so
    round 2 starts from each client's own momentum / Adam moments and step counts."""
    method = _vit_method("fedhpl")
    client = method.client
    assert client.keep_optimizer
    server = method.strategy.init_state(len(SIZES))
    g = torch.Generator().manual_seed(2)
    server["logits"] = torch.randn(server["logits"].shape, generator=g)
    server["mask"] = (torch.rand(server["mask"].shape, generator=g) > 0.3).float()
    states = _states(method, perturb=False)
    first = _round(method, server, states, TrainSettings(2, 4, opt), (3, 16, 16))
    assert all(st["optimizer"]["state"] for st, _ in first)
    _round(method, server, [st for st, _ in first], TrainSettings(1, 4, opt), (3, 16, 16))


@pytest.fixture(scope="module")
def clip():
    return tiny_clip()


@pytest.mark.parametrize("name, params", [("coop", {}), ("promptfl", {}), ("promptfl_fedprox", {"mu": 0.5}),
                                          ("fedotp", {}), ("fedotp", {"ot": "classical", "ot_stop": "batch"})],
                         ids=["coop", "promptfl", "promptfl_fedprox", "fedotp", "fedotp_classical"])
def test_clip_text_contexts(clip, name, params):
    """CoOp, PromptFL, PromptFL + FedProx (each client's own proximal anchor), FedOTP (global + local prompts, OT per
    image): every client's prompts through the text tower in one call per step."""
    torch.manual_seed(1)
    method = method_class(name)(clip, len(NAMES), params, class_names=NAMES)
    assert method.client.together("cpu", method.model).fit is not None
    server = method.strategy.init_state(len(SIZES))
    _round(method, server, _states(method), TrainSettings(2, 4, SGD), (3, 16, 16), {TOKENS: (17, 24)})


def test_uneven_clients_drop_out_and_owners_read_their_rows():
    """A client whose stream ends takes no further step (its optimiser rows do not move); ``Owners`` reads rows."""
    owners = Owners((2, 0), (3, 1))
    stacked = torch.arange(12.0).view(3, 4)
    assert [r.tolist() for r in owners.of(stacked)] == [stacked[2].tolist(), stacked[0].tolist()]
    assert owners.expand(stacked).shape == (4, 4) and torch.equal(owners.expand(stacked)[3], stacked[0])
    batch = concat_batches([Batch(torch.ones(3, 2), torch.zeros(3), torch.arange(3), {}),
                            Batch(torch.zeros(1, 2), torch.ones(1), torch.arange(1), {})])
    assert batch.x.shape == (4, 2) and batch.y.tolist() == [0, 0, 0, 1]

    w = torch.nn.Parameter(torch.zeros(2))
    model = torch.nn.Module()
    model.w = w
    starts = [{"w": torch.zeros(2)}, {"w": torch.ones(2)}]
    streams = [iter([torch.ones(2, 2)] * 3), iter([torch.ones(1, 2)])]
    out = train_one_pass(model, ["w"], ["w"], starts, streams,
                         lambda m, b, o: torch.stack([(x @ r).sum() for x, r in zip(o.split(b), o.of(m.w))]),
                         SGD, keep_optimizer=True)
    assert [f.steps for f in out] == [3, 1]
    buf = out[1].optimizer["state"][0]["momentum_buffer"]
    assert torch.equal(buf, torch.ones(2) + 1e-3)  # one step: grad 1 + weight decay x 1
    assert torch.equal(model.w, torch.zeros(2))     # the model's own tensor untouched


def test_the_cpu_takes_the_one_pass():
    """The per-device choice (benchmarks/bench_onepass.py): the one pass on the CPU and on CUDA."""
    assert {"cpu", "cuda"} <= ONE_PASS_ON


def personal_eval_case(clip, name: str, n: int):
    """(method, model, states, split, pipeline, server, plan) of a personalised evaluation: Local (ViT) or a CLIP
    prompt method, three clients whose models differ, a test split of ``n`` images (CLIP: with image tokens)."""
    from fedcore.engine import evaluate

    torch.manual_seed(1)
    vit = name == "local"
    method = _vit_method(name) if vit else method_class(name)(clip, len(NAMES), {}, class_names=NAMES)
    model = method.model.eval()
    g = torch.Generator().manual_seed(4)
    split = evaluate.DeviceSplit(torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8),
                                 torch.randint(0, CLASSES, (n,), generator=g),
                                 extras={} if vit else {TOKENS: torch.randn(n, 17, 24, generator=g)})
    pipeline = evaluate.InputPipeline(16, (0.5,) * 3, (0.25,) * 3)
    states = _states(method)
    plan = method.evaluator.one_pass(model)
    assert plan is not None
    return method, model, states, split, pipeline, method.strategy.init_state(len(states)), plan


def stacked_clients(method, model, plan, server, states, alone) -> tuple[dict[str, Tensor], list]:
    """Each client's model loaded in turn: its per-client tensors stacked (client axis first) and ``alone(c)``, its
    predictions one client at a time."""
    snaps, out = [], []
    for c, st in enumerate(states):
        method.evaluator.load(model, c, server, st, None)
        snaps.append({k: t.clone() for k, t in model.state_dict(keep_vars=True).items()})
        out.append(alone(c))
    names = [k for k in method.keys(0) if plan.per_client is None or k in plan.per_client]
    return {k: torch.stack([s[k].detach() for s in snaps]) for k in names}, out


@pytest.mark.parametrize("name", ["local", "coop", "fedotp"])
def test_personalised_evaluation_in_one_pass_gives_the_same_predictions(clip, name, monkeypatch):
    """Every client's own model scores the test set in one pass (``Evaluator.one_pass``): the predictions of one
    client at a time, client for client (so every accuracy is the same). The clients' text features (CLIP prompts)
    go through the text tower once for the whole split, not once per test batch."""
    from fedcore.engine import evaluate
    from fedcore.engine.evaluate import predict

    method, model, states, split, pipeline, server, plan = personal_eval_case(clip, name, 13)
    idx = torch.arange(13)
    with attention_backend("cpu"):
        stacked, alone = stacked_clients(method, model, plan, server, states,
                                         lambda c: predict(method, model, split, idx, pipeline, 4))
        text_passes = []
        if name != "local":
            encode = clip.encode_text_with_context
            monkeypatch.setattr(clip, "encode_text_with_context", lambda *a: text_passes.append(1) or encode(*a))
        together = evaluate.predict_clients(method, model, plan, stacked, split, idx, pipeline, 4)
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    assert len(text_passes) == (0 if name == "local" else 1)   # 4 test batches, one group of clients
    assert len({tuple(p.tolist()) for p in alone}) > 1  # the clients' models do differ


def test_the_compile_switch_reaches_the_one_pass_step_and_the_fingerprint(monkeypatch):
    """``RunSpec.compile`` (CUDA only, default off): the one-pass step under ``torch.compile(mode=...)``; a run
    compiled is another run (its checkpoints are not resumed eagerly), an eager run keeps its fingerprint."""
    from fedcore.engine.loop import RunSpec

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(2))
    train_one_pass(model, ["w"], ["w"], [{"w": torch.zeros(2)}], [iter([torch.ones(1, 2)])],
                   lambda m, b, o: torch.stack([(x @ r).sum() for x, r in zip(o.split(b), o.of(m.w))]), SGD,
                   compile_mode="reduce-overhead")
    assert seen == [{"mode": "reduce-overhead", "dynamic": False}]
    spec = RunSpec({"seed": 0}, {"rounds": 1}, SGD)
    assert spec.compile is None and RunSpec({"seed": 0}, {"rounds": 1}, SGD, compile="default").fingerprint() \
        != spec.fingerprint()


def test_a_round_of_many_clients_trains_in_several_passes(monkeypatch):
    """More clients than ``PASS_SAMPLES`` allows in one pass: several passes, the same outcomes."""
    from fedcore.engine import batching

    method = _vit_method("local")
    server = method.strategy.init_state(len(SIZES))
    monkeypatch.setattr(batching, "PASS_SAMPLES", 8)       # 2 clients a pass at batch 4
    calls = []
    real = batching.one_pass_epochs
    monkeypatch.setattr(batching, "one_pass_epochs", lambda *a, **k: calls.append(len(a[4])) or real(*a, **k))
    _round(method, server, _states(method), TrainSettings(1, 4, SGD), (3, 16, 16))
    assert calls == [2, 1]


@pytest.mark.parametrize("name", ["fedvpt", "sgpt"])
def test_the_one_pass_step_traces_without_graph_breaks(name, monkeypatch):
    """What ``compile_one_pass`` compiles: the step of a ViT prompt round traces whole (a graph break would leave
    CUDA graphs and fusion only the pieces between breaks). Dynamo's tracing only (backend ``eager``, no kernels
    built), on the CPU; the model and loss are wrapped once outside the step (a module built inside it broke the
    graph on ``functional_call``)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: compile_(fn, backend="eager", **kw))
    torch._dynamo.reset()
    counters.clear()
    params = {"groups": 5, "shared_blocks": [0, 2], "group_blocks": [1, 2], "select_block": 3} if name == "sgpt" else {}
    method = _vit_method(name, **params)
    server = method.strategy.init_state(len(SIZES))
    settings = TrainSettings(1, 4, SGD, compile="default")
    extras = {QUERY: (64,)} if name == "sgpt" else None
    plan = method.client.together("cpu", method.model)
    states = _states(method)
    downs = [method.strategy.configure(server, c) for c in range(len(states))]
    datas = [_data(c, n, (3, 16, 16), extras or {}, settings) for c, n in enumerate(SIZES)]
    try:
        with attention_backend("cpu"):
            method.model.train()
            plan.fit(states, downs, datas, settings)   # the one pass only (its equality: the tests above)
        assert counters["stats"]["unique_graphs"] >= 1  # it was traced
        assert dict(counters["graph_break"]) == {}
    finally:
        torch._dynamo.reset()
