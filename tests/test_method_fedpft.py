"""FedPFT (spec fedpft §1): gradient routing of the two phases, the MoCo queue and key encoder, what is uploaded,
Table 10's upload counts, the on-device views, and a tiny end-to-end run."""
from __future__ import annotations

import pytest
import torch

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch, InputPipeline, moco_v1
from fedcore.engine.optim import ClientData, TrainSettings, only_training
from fedcore.engine.roles import FitResult
from fedcore.methods.fedpft import FedPFT, phase_plan
from fedcore.methods.pft_modules import enqueue, momentum_update
from fedcore.train import train_run

PIPE = InputPipeline(16, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
SETTINGS = TrainSettings(local_epochs=2, batch_size=8, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9})


def _method(**params) -> FedPFT:
    torch.manual_seed(0)
    return FedPFT(prompt_adapter(build_backbone("resnet8_pft_mini")), 4,
                  {"queue_size": 16, "n_kappa": 3, "n_rho": 2, "feature_epochs": 1, **params})


def _data(seed: int = 0, n: int = 16) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x = PIPE(torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8))
    y = torch.arange(n) % 4
    gen = torch.Generator().manual_seed(seed + 1)
    batches = lambda: (Batch(x[i:i + 8], y[i:i + 8], torch.arange(i, i + 8), {}) for i in range(0, n, 8))  # noqa: E731
    return ClientData(0, n, batches, gen, SETTINGS, lambda t, name: PIPE.augment(t, name, gen))


def _ready(method: FedPFT):
    """The model loaded with client 0's initial state and a MoCo state to train with."""
    client, model = method.client, method.model.train()
    state = client.init_state(0)
    client.start(model, 0, state, method.strategy.configure(method.strategy.init_state(1), 0))
    return model, {"queue": state["moco"]["queue"].clone(), "ptr": 0}


def _grads(model, loss) -> dict[str, bool]:
    """Which parts got a gradient from ``loss`` (params of frozen parts have requires_grad off)."""
    for p in model.parameters():
        p.grad = None
    loss.backward(retain_graph=True)
    parts = {}
    for name, p in model.named_parameters():
        part = name.split(".")[0]
        parts[part] = parts.get(part, False) or (p.grad is not None and bool(p.grad.abs().sum() > 0))
    return parts


@pytest.mark.parametrize("tau_con", [True, False])
def test_each_phase_routes_each_loss_to_exactly_its_parts(tau_con):
    method = _method(tau_con_grad_task=tau_con)
    model, moco = _ready(method)
    feature, task = (ph for ph, _ in phase_plan(method.params, 5))
    trainable = method.trainable_keys(0)
    batch = next(_data().batches())
    with only_training(model, [k for k in trainable if k.split(".")[0] in feature.train]):
        ce, con, _ = method.client.losses(model, feature, batch, _data(), moco)
        g_ce, g_con = _grads(model, ce), _grads(model, con)
    # feature phase: φ learns from L_Con only; h_κ and p_ρ are frozen; p_κ learns from L_CE
    assert g_ce == {"net": False, "tau": True, "head": False, "con_head": False, "p_kappa": True, "p_rho": False,
                    "key": False}
    assert g_con == {"net": True, "tau": True, "head": False, "con_head": True, "p_kappa": False, "p_rho": False,
                     "key": False}
    with only_training(model, [k for k in trainable if k.split(".")[0] in task.train]):
        ce, con, _ = method.client.losses(model, task, batch, _data(), moco)
        g_ce, g_con = _grads(model, ce), _grads(model, con)
    # task phase: φ learns from L_CE only; p_κ and h_ρ are frozen; p_ρ learns from L_Con (τ too unless the flag)
    assert g_ce == {"net": True, "tau": True, "head": True, "con_head": False, "p_kappa": False, "p_rho": False,
                    "key": False}
    assert g_con == {"net": False, "tau": tau_con, "head": False, "con_head": False, "p_kappa": False, "p_rho": True,
                     "key": False}


@pytest.mark.parametrize("feature_epochs, frozen, moved", [(2, ("head.", "p_rho"), ("p_kappa", "net.", "con_head.")),
                                                            (0, ("p_kappa", "con_head."), ("head.", "p_rho", "net."))])
def test_a_phase_leaves_its_frozen_tensors_unchanged(feature_epochs, frozen, moved):
    method = _method(feature_epochs=feature_epochs)
    model, moco = _ready(method)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stats = method.client.run_round(model, 0, 0, _data(), SETTINGS, moco)
    after = model.state_dict()
    for k in before:
        if k.startswith(frozen):
            assert torch.equal(before[k], after[k]), k
    for prefix in moved:
        assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(prefix)), prefix
    phase = "feature" if feature_epochs else "task"
    assert {f"ce_{phase}", f"con_{phase}", "ce", "con"} <= set(stats)


@pytest.mark.parametrize("scope", ["phase", "round"])
def test_in_the_task_phase_phi_moves_by_l_ce_alone(scope, monkeypatch):
    """Paper l.137: in the task phase "ϕi is updated solely by L_CE". With L_CE zeroed there, φ's parameters end the
    round where the feature phase left them, unless one optimiser's momentum carries L_Con's steps over (``round``)."""
    losses = FedPFT.client_role.losses

    def no_task_ce(self, model, phase, batch, data, moco):
        ce, con, key = losses(self, model, phase, batch, data, moco)
        return (ce * 0 if phase.name == "task" else ce), con, key

    monkeypatch.setattr(FedPFT.client_role, "losses", no_task_ce)
    phi = {}
    for local_epochs in (1, 2):                 # R_f = 1: the feature phase alone, then with a task phase after it
        method = _method(optimizer_scope=scope)
        model, moco = _ready(method)
        settings = TrainSettings(local_epochs=local_epochs, batch_size=8, optimizer=SETTINGS.optimizer)
        method.client.run_round(model, 0, 0, _data(), settings, moco)
        phi[local_epochs] = {k: v.detach().clone() for k, v in model.net.named_parameters()}
    same = all(torch.equal(phi[1][k], phi[2][k]) for k in phi[1])
    assert same == (scope == "phase")


def test_without_contrastive_the_feature_phase_trains_only_prompts_and_tau():
    method = _method(contrastive=False, feature_epochs=2)
    model = method.model.train()
    assert model.con_head is None and model.p_rho is None and model.key is None
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    method.client.run_round(model, 0, 0, _data(), SETTINGS, None)
    changed = {k.split(".")[0] for k, v in model.state_dict().items()
               if v.is_floating_point() and not torch.equal(before[k], v)}
    assert changed == {"p_kappa", "tau", "net"}          # net: only its BatchNorm running statistics
    assert all(torch.equal(before[k], v) for k, v in model.net.state_dict(prefix="net.").items()
               if "running" not in k and "num_batches" not in k)


def test_the_queue_is_first_in_first_out_and_wraps():
    queue = torch.zeros(2, 5)
    keys = torch.arange(1.0, 7.0).view(3, 2)              # three keys [1,2], [3,4], [5,6]
    ptr = enqueue(queue, 0, keys)
    assert ptr == 3 and queue[:, :3].T.tolist() == [[1, 2], [3, 4], [5, 6]] and queue[:, 3:].abs().sum() == 0
    ptr = enqueue(queue, ptr, keys + 10)                  # overwrites columns 3, 4, then the oldest (0)
    assert ptr == 1 and queue.T.tolist() == [[15, 16], [3, 4], [5, 6], [11, 12], [13, 14]]
    assert enqueue(queue, 0, torch.arange(12.0).view(6, 2)) == 1       # more keys than K: the last K remain
    assert queue[:, 0].tolist() == [10, 11] and queue[:, 1].tolist() == [2, 3]


def test_the_key_encoder_moves_by_the_momentum_rule():
    method = _method()
    model = method.model
    key, q = model.key, {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in key.parameters():
            p.add_(1.0)
    old = {n: p.detach().clone() for n, p in key.named_parameters()}
    momentum_update(key, model, 0.9)
    for n, p in key.named_parameters():
        assert torch.allclose(p, 0.9 * old[n] + 0.1 * q[n], atol=1e-6), n


def test_uplinks_hold_the_shared_parts_only_and_batchnorm_statistics_are_averaged():
    method = _method()
    keys = method.keys(0)
    shared = method.client.shared_keys(keys)
    assert set(method.client.personal_keys(keys)) == {"p_kappa", "p_rho"}
    assert not any(k.startswith(("p_", "key.")) for k in shared)
    assert {"net.bn1.running_mean", "tau.attn.in_proj_weight", "head.weight", "con_head.weight"} <= set(shared)
    state, res = method.client.fit(0, method.client.init_state(0),
                                   method.strategy.configure(method.strategy.init_state(2), 0), _data(), SETTINGS)
    assert set(res.uplink) == {"model"} and list(res.uplink["model"]) == shared
    assert set(state) == {"model", "moco"} and set(state["model"]) == {"p_kappa", "p_rho"}
    up_a = {k: torch.zeros_like(v) for k, v in res.uplink["model"].items()}
    up_b = {k: torch.full_like(v, 4) for k, v in res.uplink["model"].items()}
    server = method.strategy.aggregate(_info(), method.strategy.init_state(2),
                                       [FitResult(0, 10, {"model": up_a}, {}), FitResult(1, 30, {"model": up_b}, {})])
    assert torch.allclose(server["model"]["net.bn1.running_var"], torch.full_like(up_a["net.bn1.running_var"], 3.0))
    personal = _method(classifier="personal").client.personal_keys(keys)
    assert set(personal) == {"p_kappa", "p_rho", "head.weight", "head.bias"}


def _info():
    from fedcore.engine.roles import RoundInfo
    return RoundInfo(1, 2, 1.0, 0)


def test_prompts_are_drawn_per_client_from_the_seed_or_identical_when_asked():
    a, b = _method(), _method()
    s0, s1 = a.client.init_state(0)["model"], a.client.init_state(1)["model"]
    assert torch.equal(s0["p_kappa"], b.client.init_state(0)["model"]["p_kappa"])
    assert not torch.equal(s0["p_kappa"], s1["p_kappa"])
    assert 0.01 < float(s0["p_rho"].std()) < 0.04
    same = _method(prompt_init="identical").client
    assert torch.equal(same.init_state(0)["model"]["p_kappa"], same.init_state(3)["model"]["p_kappa"])


@pytest.mark.parametrize("arch, classes, phi, tau, h_kappa, h_rho, printed", [
    ("resnet8_pft", 100, 1_235_392, 263_168, 25_700, 32_896, (1.24e6, 0.26e6, 25.70e3, 32.90e3)),
    ("resnet10_pft", 100, 4_911_552, 1_050_624, 51_300, 65_664, (4.91e6, 1.05e6, 51.30e3, 65.66e3))])
def test_upload_counts_per_client_are_table_10s(arch, classes, phi, tau, h_kappa, h_rho, printed):
    torch.manual_seed(0)
    method = FedPFT(prompt_adapter(build_backbone(arch)), classes, {"queue_size": 8})
    init = method.initial_state(0, method.client.shared_keys(method.keys(0)))
    counts = {}
    for k, v in init.items():
        if not k.endswith("num_batches_tracked"):        # Table 10 counts the running statistics, not the counters
            counts[k.split(".")[0]] = counts.get(k.split(".")[0], 0) + v.numel()
    assert counts == {"net": phi, "tau": tau, "head": h_kappa, "con_head": h_rho}
    units = (1e6, 1e6, 1e3, 1e3)
    for ours, paper, unit in zip((phi, tau, h_kappa, h_rho), printed, units, strict=True):
        assert round(ours / unit, 2) == round(paper / unit, 2)


def test_views_are_deterministic_per_generator_and_the_two_views_differ():
    x = PIPE(torch.randint(0, 256, (6, 16, 16, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    v1, w1 = PIPE.augment(x, "moco_v1", g1), PIPE.augment(x, "moco_v1", g1)
    v2, w2 = PIPE.augment(x, "moco_v1", g2), PIPE.augment(x, "moco_v1", g2)
    assert torch.equal(v1, v2) and torch.equal(w1, w2)
    assert not torch.allclose(v1, w1) and not torch.allclose(v1, x)
    pixels = x * 0.25 + 0.5                                 # the pipeline augments the un-normalised pixels
    assert torch.allclose(v1, (moco_v1(pixels, torch.Generator().manual_seed(5)) - 0.5) / 0.25, atol=1e-5)
    rot = PIPE.augment(x, "rotate15", torch.Generator().manual_seed(1))
    assert rot.shape == x.shape and not torch.equal(rot, x)


def test_the_colour_jitter_matches_torchvision_at_fixed_factors():
    import torchvision.transforms.functional as TF

    from fedcore.engine import data as D

    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    hsv = D._rgb_to_hsv(x)
    shifted = D._hsv_to_rgb(torch.stack([torch.remainder(hsv[:, 0] + 0.3, 1.0), hsv[:, 1], hsv[:, 2]], 1))
    assert torch.allclose(shifted, TF.adjust_hue(x, 0.3), atol=1e-5)
    assert torch.allclose(D._grey(x), TF.rgb_to_grayscale(x), atol=1e-3)


def test_two_stage_sends_stage_one_then_two_and_bad_combinations_are_refused():
    method = _method(two_stage=2)
    state = method.strategy.init_state(2)
    assert method.strategy.configure(state, 0)["stage"] == 1
    state = method.strategy.aggregate(_info(), state, [])
    state = {**state, "rounds_done": 2}
    assert method.strategy.configure(state, 0)["stage"] == 2
    assert [ph.name for ph, _ in phase_plan(method.params, 5, stage=1)] == ["contrastive"]
    assert [(ph.name, ph.con) for ph, _ in phase_plan(method.params, 5, stage=2)] == [("feature", False),
                                                                                      ("task", False)]
    with pytest.raises(ValueError, match="'tau' = False needs 'alternate' = False"):
        _method(tau=False)
    with pytest.raises(ValueError, match="feature_epochs"):
        FedPFT.check_federation({**FedPFT.defaults, "feature_epochs": 6}, {"local_epochs": 5})


def test_a_run_trains_end_to_end_and_its_moco_state_survives_a_resume(tiny_run_files, tmp_path):
    params = {**run_params(rounds=2, participation=1.0, local_epochs=2), "method_params": {"queue_size": 32, "feature_epochs": 1,
                                                                           "n_kappa": 2, "n_rho": 2}}

    def run(name: str, stop: int | None = None, ckpt=None):
        out = tmp_path / name
        out.mkdir(exist_ok=True)
        return train_run(params, identity("fedpft"), tiny_run_files["dataset"], tiny_run_files["partition"],
                         "resnet8_pft_mini", None, out / "m.parquet", out / "f.pt", progress=False,
                         checkpoint_path=ckpt, stop_after_round=stop)

    full = run("full")
    assert run("part", stop=1, ckpt=tmp_path / "ck.pt") is None
    resumed = run("part", ckpt=tmp_path / "ck.pt")
    m = full.metrics
    assert {"ce_feature", "con_feature", "ce_task", "con_task"} <= set(m.loc[m.split == "train", "metric"])
    assert m["value"].notna().all()
    assert m.equals(resumed.metrics)
    moco = full.client_states[0]["moco"]
    from fedcore.partition.file import Partition
    n0 = len(Partition.load(tiny_run_files["partition"]).train[0])
    assert int(moco["ptr"]) == (2 * 2 * n0) % 32          # 2 rounds x 2 epochs of client 0's keys enqueued
    for c, st in full.client_states.items():
        assert torch.equal(st["moco"]["queue"], resumed.client_states[c]["moco"]["queue"])
        assert torch.equal(st["moco"]["key"]["net.conv1.weight"], resumed.client_states[c]["moco"]["key"]["net.conv1.weight"])
    assert not torch.equal(full.client_states[0]["moco"]["queue"], full.client_states[1]["moco"]["queue"])


def test_the_base_augmentation_reaches_the_ce_view_only_and_moco_views_start_from_the_raw_batch():
    """A21 with A5: FedPFT takes raw batches (train_augment), applies the experiment's augment to its CE view and
    makes both MoCo views from the un-augmented images."""
    method = _method()
    model, moco = _ready(method)
    data, calls = _data(), []
    raw = next(data.batches()).x
    inner = data.augment
    data.augment = lambda t, name: calls.append((name, torch.equal(t, raw))) or inner(t, name)  # noqa: E731
    data.base_augment = ("crop_flip", "rotate15")
    feature, _ = phase_plan(method.params, 2)[0]
    method.client.losses(model, feature, next(data.batches()), data, moco)
    assert method.client.train_augment(("crop_flip",)) == ((), ("crop_flip",))
    assert calls == [("crop_flip", True), ("rotate15", False), ("moco_v1", True), ("moco_v1", True)]
class _Pipe64(InputPipeline):
    """PIPE in float64: the batched and the one-by-one round are compared without fp32 rounding, which the
    training's chaos (lr 0.1, batches of 4 through BatchNorm) amplifies to ~5e-5 relative in a few steps."""

    def __call__(self, x_uint8):
        return super().__call__(x_uint8).double()


def _client_data(cid: int, n: int, seed: int, pipe: InputPipeline = PIPE, base: tuple[str, ...] = ()) -> ClientData:
    """Client ``cid``'s ``n`` images (a short last batch when n % 8), views drawn from its own generator, the
    pipeline given as the engine gives it."""
    g = torch.Generator().manual_seed(seed)
    x = pipe(torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8))
    y = torch.randint(0, 4, (n,), generator=g)
    gen = torch.Generator().manual_seed(seed + 1)

    def batches():
        order = torch.randperm(n, generator=gen)  # the shuffle draws from the same generator, as the engine's
        return (Batch(x[order[i:i + 8]], y[order[i:i + 8]], order[i:i + 8], {}) for i in range(0, n, 8))

    return ClientData(cid, n, batches, gen, SETTINGS, lambda t, name: pipe.augment(t, name, gen), base,
                      pipeline=pipe)


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("params, base", [({}, ("crop_flip",)), ({"contrastive": False}, ())],
                         ids=["fedpft", "without_con"])
def test_clients_trained_together_equal_clients_trained_one_by_one(params, base, float64):
    method = _method(**params)
    client, sizes, pipe = method.client, (8, 12, 8), _Pipe64(16, (0.5,) * 3, (0.25,) * 3)  # 1, 2, 1 batches an
    server = method.strategy.init_state(3)                                  # epoch: the phases change apart
    states = [client.init_state(c) for c in range(3)]
    for c, st in enumerate(states):
        if "moco" in st:                                     # queues written elsewhere, pointers apart
            st["moco"] = {**st["moco"], "ptr": 5 * c, "queue": st["moco"]["queue"].roll(c, 1)}
    downs = [method.strategy.configure(server, c) for c in range(3)]
    datas = [_client_data(c, n, c, pipe, base) for c, n in enumerate(sizes)]
    together = client.fit_together(states, downs, datas, SETTINGS)
    alone = []
    for c, n in enumerate(sizes):
        method.model.train()
        alone.append(client.fit(c, states[c], downs[c], _client_data(c, n, c, pipe, base), SETTINGS))
    close = dict(atol=1e-9, rtol=1e-9)
    for (sa, ra), (sb, rb) in zip(together, alone, strict=True):
        assert ra.uplink["model"]["net.conv1.weight"].dtype == torch.float64
        for name in sb["model"]:                                    # the prompts
            torch.testing.assert_close(sa["model"][name], sb["model"][name], **close)
        for name, v in rb.uplink["model"].items():                  # φ with its BatchNorm statistics, τ, h_κ, h_ρ
            torch.testing.assert_close(ra.uplink["model"][name], v, **close, msg=name)
        assert ra.stats.keys() == rb.stats.keys() and all(abs(ra.stats[k] - rb.stats[k]) < 1e-9 for k in rb.stats)
        assert ("moco" in sa) == ("moco" in sb) == ("contrastive" not in params)
        if "moco" in sb:
            assert sa["moco"]["ptr"] == sb["moco"]["ptr"]
            torch.testing.assert_close(sa["moco"]["queue"], sb["moco"]["queue"], **close)
            for name, v in sb["moco"]["key"].items():              # the key encoder: EMA weights, own BN buffers
                torch.testing.assert_close(sa["moco"]["key"][name], v, **close, msg=name)
    if "moco" in alone[0][0]:
        assert [s["moco"]["ptr"] for s, _ in alone] == [(5 * c + 2 * n) % 16 for c, n in enumerate(sizes)]
        assert {"ce_feature", "con_feature", "ce_task", "con_task"} <= set(together[0][1].stats)


@pytest.mark.parametrize("mode, cpu_reason", [("auto", "one by one on the CPU: batching was not measured faster"), ("batched", None),
                                              ("one_by_one", "client_batching: one_by_one")])
def test_the_config_chooses_batched_or_one_by_one_and_nothing_falls_back_silently(mode, cpu_reason):
    from fedcore.engine.loop import _why_not_together
    method = _method(client_batching=mode)
    why = _why_not_together(method)
    assert why is None if cpu_reason is None else cpu_reason in why
    with pytest.raises(ValueError, match="client_batching"):
        _method(client_batching="yes")
    if mode == "batched":                                    # asked for and impossible: an error, not one by one
        data = _client_data(0, 8, 0)
        data.pipeline = None
        client = method.client
        with pytest.raises(ValueError, match="ClientData.pipeline: None for clients \\[0\\]"):
            client.fit_together([client.init_state(0)], [method.strategy.configure(method.strategy.init_state(1), 0)],
                                [data], SETTINGS)
