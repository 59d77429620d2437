"""FedPFT (arXiv 2407.16139) equation by equation: each test computes the paper's formula by hand in plain torch on
tiny tensors (never through fedcore's helpers) and compares it with what our code computes.

Paper lines refer to /work/shared/papers/fedpft_arxiv2407.16139.txt. Pinned here: τ (Eq. 2, App. F self-attention,
token 0; Fig. 6's weights), L_CE (Eq. 3, the standard cross-entropy: the printed outer "log" is a typo, see
``test_eq3_cross_entropy_is_the_batch_mean_of_minus_log_softmax``), L_Con (Eq. 4 with MoCo's defaults), each phase's
gradients per parameter group (Eqs. 5, 6 and l.129/l.137's routing of φ), a round's parameter updates (Algorithm 1:
feature phase then task phase; SGD, τ at lr 0.01, the rest at 0.1, App. B.3), the uplink and the server's FedAvg
(§3.6), the personalised prediction (Algorithm 1's output), and App. B.3's hyperparameters in the config.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings, only_training
from fedcore.engine.roles import FitResult, RoundInfo
from fedcore.methods.fedpft import FedPFT, phase_plan
from fedcore.methods.pft_modules import Views

ROOT = Path(__file__).resolve().parents[1]
N, CLASSES, SIDE = 8, 4, 16          # one batch of 8 images of 16 px, 4 classes
LR, TAU_LR, MOM = 0.1, 0.01, 0.9     # App. B.3: 0.1 for the others, 0.01 for τ; SGD momentum 0.9 (spec §2 [R])
SETTINGS = TrainSettings(local_epochs=2, batch_size=N, optimizer={"name": "sgd", "lr": LR, "momentum": MOM})
TOL = dict(atol=2e-5, rtol=1e-4)
KEY_M, BETA = 0.75, 0.2              # MoCo's momentum and temperature in these tests


def _method(**params) -> FedPFT:
    """FedPFT on the mini ResNet-8 (m = 64), 4 heads, small prompt sets and queue; MoCo momentum 0.75 (not 0.5,
    where swapping m and 1 − m changes nothing) and β = 0.2, so that the EMA and the temperature move the numbers."""
    torch.manual_seed(0)
    base = {"queue_size": 16, "n_kappa": 3, "n_rho": 2, "heads": 4, "feature_epochs": 1, "moco_momentum": KEY_M,
            "temperature": BETA}
    return FedPFT(prompt_adapter(build_backbone("resnet8_pft_mini")), CLASSES, {**base, **params})


def _ready(method: FedPFT):
    """The model holding client 0's start of a round (global tensors + own prompts), its key encoder moved away from
    φ and h_ρ (as after earlier rounds), and its MoCo queue."""
    client, model = method.client, method.model.train()
    state = client.init_state(0)
    client.start(model, 0, state, method.strategy.configure(method.strategy.init_state(1), 0))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.key.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, {"queue": state["moco"]["queue"].clone(), "ptr": 0}


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 3, SIDE, SIDE, generator=g), torch.arange(N) % CLASSES


# ---- the paper's formulas, by hand ---------------------------------------------------------------------------
def hand_tau(w: dict[str, torch.Tensor], f: torch.Tensor, prompts: torch.Tensor | None, heads: int):
    """Eq. 2 with App. F's self-attention: X = [f, p_1..p_n] (B, 1+n, m); every token attends to every token
    (multi-head, scaled dot product); f' = output token 0. Returns f' and token 0's weights averaged over heads."""
    x = f[:, None, :] if prompts is None else torch.cat([f[:, None, :], prompts[None].expand(len(f), -1, -1)], 1)
    b, t, m = x.shape
    d = m // heads
    wq, wk, wv = w["in_proj_weight"].split(m)
    bq, bk, bv = w["in_proj_bias"].split(m)
    split = lambda z: z.reshape(b, t, heads, d).transpose(1, 2)  # noqa: E731  (B, H, T, d)
    q, k, v = split(x @ wq.T + bq), split(x @ wk.T + bk), split(x @ wv.T + bv)
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)            # (B, H, T, T)
    out = (a @ v).transpose(1, 2).reshape(b, t, m) @ w["out_proj.weight"].T + w["out_proj.bias"]
    return out[:, 0], a[:, :, 0].mean(1)


def _tau_w(model, detach: bool = False) -> dict[str, torch.Tensor]:
    w = {n[len("attn."):]: p for n, p in model.tau.named_parameters()}
    return {n: p.detach() for n, p in w.items()} if detach else w


def hand_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. 3 (outer log dropped): −Σ_c y_c log o_c with o = Softmax(logits), y one-hot; E_{d_i}: the batch mean."""
    o = torch.exp(logits) / torch.exp(logits).sum(1, keepdim=True)
    onehot = torch.zeros_like(o)
    onehot[torch.arange(len(y)), y] = 1.0
    return (-(onehot * torch.log(o)).sum(1)).mean()


def hand_con(q: torch.Tensor, k_pos: torch.Tensor, queue: torch.Tensor, beta: float) -> torch.Tensor:
    """Eq. 4: −log exp(q·k₊/β) / Σ_{j=0..K} exp(q·k_j/β), k_0 = k₊ and k_1..k_K the queue's columns; batch mean."""
    num = torch.exp((q * k_pos).sum(1) / beta)
    den = num + torch.exp(q @ queue / beta).sum(1)
    return (-torch.log(num / den)).mean()


def unit(z: torch.Tensor) -> torch.Tensor:
    """MoCo's L2 normalisation of q and k (App. B.3: MoCo's default settings)."""
    return z / z.norm(dim=1, keepdim=True)


def hand_key_update(key, model, m: float) -> None:
    """MoCo's momentum encoder: θ̃ ← m θ̃ + (1 − m) θ for φ̃ and h̃_ρ (parameters; BatchNorm buffers stay the key's)."""
    with torch.no_grad():
        for part in ("net", "con_head"):
            for pk, pq in zip(key[part].parameters(), getattr(model, part).parameters(), strict=True):
                pk.copy_(m * pk + (1.0 - m) * pq)


def hand_losses(h, phase: str, views: Views, queue: torch.Tensor, m: float, beta: float, heads: int,
                tau_con: bool = True):
    """L_CE and L_Con of one step on model ``h`` as Eqs. 3-6 and l.129/l.137 route them (detach = not in the phase's
    min-set for this loss): feature phase (Eq. 5) trains p_κ, φ, τ, h_ρ with φ updated by L_Con alone; task phase
    (Eq. 6) trains φ, τ, h_κ, p_ρ with φ updated by L_CE alone. Updates ``h.key`` by the EMA first (MoCo), then the
    positive key k₊ = h̃_ρ∘τ([φ̃(x''), p_ρ]) (the same τ and p_ρ, no gradient)."""
    feat = phase == "feature"
    d = lambda t, keep: t if keep else t.detach()  # noqa: E731
    tau = _tau_w(h)
    f = d(h.net(views.base), not feat)
    z = hand_tau(tau, f, d(h.p_kappa, feat), heads)[0]
    ce = hand_ce(z @ d(h.head.weight, not feat).T + d(h.head.bias, not feat), views.y)
    f1 = d(h.net(views.query), feat)
    tau_q = tau if (feat or tau_con) else _tau_w(h, detach=True)
    z = hand_tau(tau_q, f1, d(h.p_rho, not feat), heads)[0]
    q = unit(z @ d(h.con_head.weight, feat).T + d(h.con_head.bias, feat))
    hand_key_update(h.key, h, m)
    with torch.no_grad():
        zk = hand_tau(_tau_w(h, detach=True), h.key["net"](views.key), h.p_rho.detach(), heads)[0]
        k = unit(zk @ h.key["con_head"].weight.T + h.key["con_head"].bias)
    return ce, hand_con(q, k, queue, beta), k


TRAINED = {"feature": ("p_kappa", "net", "tau", "con_head"), "task": ("net", "tau", "head", "p_rho")}


# ---- Eq. 2 / App. F: τ -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_prompts", [3, 0])
def test_eq2_tau_is_self_attention_over_feature_and_prompts_read_at_token_0(n_prompts):
    method = _method()
    model = method.model
    g = torch.Generator().manual_seed(1)
    f = torch.randn(5, model.feature_dim, generator=g)
    prompts = torch.randn(n_prompts, model.feature_dim, generator=g) if n_prompts else None
    want, weights = hand_tau(_tau_w(model, detach=True), f, prompts, heads=4)
    torch.testing.assert_close(model.transform(f, prompts), want, **TOL)
    # Fig. 6: token 0's attention over [f, p_1..p_n], averaged over heads; each row sums to 1
    torch.testing.assert_close(model.tau.attention(f, prompts), weights, **TOL)
    assert weights.shape == (5, 1 + n_prompts) and torch.allclose(weights.sum(1), torch.ones(5))


# ---- Eq. 3 and Eq. 4: the two losses -----------------------------------------------------------------------
def test_eq3_cross_entropy_is_the_batch_mean_of_minus_log_softmax():
    """Eq. 3 prints L_CE = −log Σ_c y_c log(o_i,c): Σ_c y_c log o ≤ 0, so its log is undefined; the outer "log" is a
    typo (spec §1.5) and we (and this test) read the standard cross-entropy −Σ_c y_c log o_c, o = Softmax(h_κ∘τ([φ(x),
    p_κ,i])), averaged over the batch (E_{d_i})."""
    method = _method()
    model, moco = _ready(method)
    x, y = _batch()
    feature = phase_plan(method.params, 2)[0][0]
    h = copy.deepcopy(model)
    ce, _, _ = method.client.branch_losses(model, feature, Views(y, x, x + 0.1, x - 0.1), moco["queue"])
    with torch.no_grad():
        z = hand_tau(_tau_w(h), h.net(x), h.p_kappa, heads=4)[0]
        want = hand_ce(z @ h.head.weight.T + h.head.bias, y)
    torch.testing.assert_close(ce, want, **TOL)


def test_eq4_moco_loss_updates_the_key_encoder_first_and_uses_the_same_tau_and_p_rho_for_the_key():
    method = _method()
    model, moco = _ready(method)
    x, y = _batch()
    views = Views(y, x, x + 0.1 * torch.randn_like(x), x - 0.1 * torch.randn_like(x))
    feature = phase_plan(method.params, 2)[0][0]
    h = copy.deepcopy(model)
    _, con, key = method.client.branch_losses(model, feature, views, moco["queue"])
    with torch.no_grad():
        _, want_con, want_key = hand_losses(h, "feature", views, moco["queue"], m=KEY_M, beta=BETA, heads=4)
    torch.testing.assert_close(key, want_key, **TOL)
    torch.testing.assert_close(con, want_con, **TOL)
    for (n, a), b in zip(model.key.named_parameters(), h.key.parameters(), strict=True):  # the EMA, in place
        torch.testing.assert_close(a, b, **TOL, msg=n)
    assert float(con.detach()) > 0 and moco["queue"].shape == (128, 16)


# ---- Eqs. 5, 6 and l.129 / l.137: which loss reaches which parameter group ---------------------------------
@pytest.mark.parametrize("phase_name, tau_con", [("feature", True), ("task", True), ("task", False)])
def test_eq5_eq6_each_phase_gradient_per_parameter_group_is_the_papers(phase_name, tau_con):
    """The summed loss's gradient on every parameter: the trained groups of Eq. 5 / Eq. 6 equal the hand gradients
    (φ: L_Con only in the feature phase, L_CE only in the task phase; τ: both losses, Eq. 6 literally, §8 A4; with
    ``tau_con_grad_task: false`` τ takes L_CE only in the task phase); the frozen groups get none."""
    method = _method(tau_con_grad_task=tau_con)
    model, moco = _ready(method)
    x, y = _batch()
    views = Views(y, x, x + 0.1 * torch.randn_like(x), x - 0.1 * torch.randn_like(x))
    phase = dict((ph.name, ph) for ph, _ in phase_plan(method.params, 2))[phase_name]
    h = copy.deepcopy(model)
    trainable = method.trainable_keys(0)
    for p in model.parameters():
        p.grad = None
    with only_training(model, [k for k in trainable if k.split(".")[0] in phase.train]):
        ce, con, _ = method.client.branch_losses(model, phase, views, moco["queue"])
        (ce + con).backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    hce, hcon, _ = hand_losses(h, phase_name, views, moco["queue"], m=KEY_M, beta=BETA, heads=4, tau_con=tau_con)
    torch.testing.assert_close(ce, hce, **TOL)
    torch.testing.assert_close(con, hcon, **TOL)
    names = [n for n, _ in h.named_parameters() if n.split(".")[0] in TRAINED[phase_name]]
    named = dict(h.named_parameters())
    want = dict(zip(names, torch.autograd.grad(hce + hcon, [named[n] for n in names], allow_unused=True)))
    for n, g in got.items():
        if n in want:
            assert g is not None, n
            torch.testing.assert_close(g, torch.zeros_like(g) if want[n] is None else want[n], atol=1e-5,
                                       rtol=1e-3, msg=n)
        else:                       # frozen in this phase (h_κ, p_ρ / p_κ, h_ρ) and the key encoder
            assert g is None or not g.any(), n
    tau_grad = want["tau.attn.in_proj_weight"]
    assert tau_grad is not None and tau_grad.abs().sum() > 0


# ---- Algorithm 1, one local round: R_f feature epochs, then R_a task epochs ---------------------------------
def _recording_data(x: torch.Tensor, y: torch.Tensor, views: list[torch.Tensor]) -> ClientData:
    """One batch an epoch; MoCo's views come from the run's augmentation, recorded for the hand computation."""
    from fedcore.engine.data import InputPipeline
    pipe = InputPipeline(SIDE, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    gen = torch.Generator().manual_seed(3)

    def augment(t: torch.Tensor, name: str) -> torch.Tensor:
        out = pipe.augment(t, name, gen)
        views.append(out)
        return out

    return ClientData(0, N, lambda: iter([Batch(x, y, torch.arange(N), {})]), gen, SETTINGS, augment)


def test_algorithm_1_a_round_is_feature_phase_then_task_phase_with_sgd_at_the_papers_learning_rates():
    """R = 3, R_f = 2, R_a = 1, one batch an epoch: steps F, F, T. By hand: each step's Eq. 5 / Eq. 6 gradients,
    SGD with lr 0.01 on τ and 0.1 on the rest (App. B.3), momentum 0.9 restarting at the phase change (our documented
    choice, DEVIATIONS FedPFT: "A fresh SGD optimiser for each phase"); MoCo: EMA, key, loss, step, enqueue."""
    method = _method(feature_epochs=2)
    model, moco = _ready(method)
    x, y = _batch()
    views: list[torch.Tensor] = []
    h = copy.deepcopy(model)
    queue = moco["queue"].clone()
    settings = TrainSettings(local_epochs=3, batch_size=N, optimizer=SETTINGS.optimizer)
    stats = method.client.run_round(model, 0, 0, _recording_data(x, y, views), settings, moco)
    assert len(views) == 6                      # two MoCo views a step, three steps
    named = dict(h.named_parameters())
    logged: dict[str, list[float]] = {}
    buf: dict[str, torch.Tensor] = {}
    for step, phase in enumerate(("feature", "feature", "task")):
        if step == 2:
            buf = {}                            # a fresh optimiser for the task phase
        v = Views(y, x, views[2 * step], views[2 * step + 1])
        ce, con, k = hand_losses(h, phase, v, queue, m=KEY_M, beta=BETA, heads=4)
        names = [n for n in named if n.split(".")[0] in TRAINED[phase]]
        grads = torch.autograd.grad(ce + con, [named[n] for n in names], allow_unused=True)
        with torch.no_grad():
            for n, g in zip(names, grads, strict=True):
                if g is None:
                    continue
                buf[n] = g.clone() if n not in buf else MOM * buf[n] + g
                named[n].sub_((TAU_LR if n.startswith("tau.") else LR) * buf[n])
            queue[:, (step * N) % 16 + torch.arange(N)] = k.T   # FIFO, after the loss read the queue
        logged.setdefault(f"ce_{phase}", []).append(float(ce.detach()))
        logged.setdefault(f"con_{phase}", []).append(float(con.detach()))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, named[n], atol=1e-4, rtol=1e-3, msg=n)
    torch.testing.assert_close(moco["queue"], queue, atol=1e-4, rtol=1e-3)
    assert moco["ptr"] == (3 * N) % 16
    for name, values in logged.items():
        assert stats[name] == pytest.approx(sum(values) / len(values), rel=1e-4), name


# ---- §3.6 / Algorithm 1: what is uploaded, how the server aggregates, what is evaluated --------------------
def test_the_uplink_is_phi_tau_h_kappa_h_rho_and_the_server_takes_their_sample_weighted_mean():
    """Upload {φ_i, τ_i, h_κ,i, h_ρ,i} (BatchNorm statistics with φ), keep p_κ,i, p_ρ,i; "the aggregation method
    used in FedAvg": Σ_i n_i w_i / Σ_i n_i."""
    method = _method()
    shared = method.client.shared_keys(method.keys(0))
    assert {k.split(".")[0] for k in shared} == {"net", "tau", "head", "con_head"}
    assert set(method.client.personal_keys(method.keys(0))) == {"p_kappa", "p_rho"}
    server = method.strategy.init_state(3)
    g = torch.Generator().manual_seed(2)
    sizes = (5, 10, 25)
    ups = [{k: (torch.randn(v.shape, generator=g) if v.is_floating_point() else torch.full_like(v, 3 * i))
            for k, v in server["model"].items()} for i in range(3)]
    new = method.strategy.aggregate(RoundInfo(1, 3, 1.0, 0), server,
                                    [FitResult(i, n, {"model": u}, {}) for i, (n, u) in enumerate(zip(sizes, ups))])
    assert set(new["model"]) == set(shared)
    for k, v in new["model"].items():
        want = sum(n * u[k].double() for n, u in zip(sizes, ups)) / sum(sizes)
        torch.testing.assert_close(v.double(), want if v.is_floating_point() else want.round(), atol=1e-6, rtol=1e-6,
                                   msg=k)


def test_the_personalised_prediction_is_the_global_model_with_the_clients_own_p_kappa():
    """Algorithm 1's output for client i: {φ^(T), τ^(T), h_κ^(T), p_κ,i^(T)}; o_i = Softmax(h_κ∘τ([φ(x), p_κ,i]))."""
    method = _method()
    model = method.model
    server = method.strategy.init_state(2)
    g = torch.Generator().manual_seed(4)
    server = {**server, "model": {k: (v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v)
                                  for k, v in server["model"].items()}}
    state = method.client.init_state(1)
    state["model"] = {k: torch.randn(v.shape, generator=g) for k, v in state["model"].items()}
    x, y = _batch(5)
    model.eval()
    method.evaluator.load(model, 1, server, state, None)
    logits = method.evaluator.predict(model, Batch(x, y, torch.arange(N), {}))
    net = copy.deepcopy(model.net)
    net.load_state_dict({k[len("net."):]: v for k, v in server["model"].items() if k.startswith("net.")})
    sm = server["model"]
    with torch.no_grad():
        tau = {k[len("tau.attn."):]: v for k, v in sm.items() if k.startswith("tau.")}
        z = hand_tau(tau, net.eval()(x), state["model"]["p_kappa"], heads=4)[0]
        want = z @ sm["head.weight"].T + sm["head.bias"]
    torch.testing.assert_close(logits, want, **TOL)


# ---- App. B.3 / §4.1: the hyperparameters the paper states -------------------------------------------------
def test_the_stated_hyperparameters_are_the_defaults_and_the_experiments():
    """(n_κ, n_ρ) = (10, 20); SGD, lr 0.01 for τ and 0.1 for the others (0.05 for τ in w/o L_Con); (R_f, R_a) =
    (3, 2) at Dirichlet α = 0.1, (4, 1) elsewhere; N = 40, B = 100, R = 5, T = 1000, every client every round (App. G:
    90/70/50 %); 500 training and 100 (Tiny: 200) test samples a client; MoCo's defaults (spec §1.5 [R]: K 65536,
    m 0.999, β 0.07, dim 128)."""
    d = FedPFT.defaults
    assert (d["n_kappa"], d["n_rho"], d["tau_lr"], d["tau_lr_no_con"]) == (10, 20, 0.01, 0.05)
    assert (d["queue_size"], d["moco_momentum"], d["temperature"], d["con_dim"]) == (65536, 0.999, 0.07, 128)
    assert d["contrastive"] and d["alternate"] and d["tau"] and d["classifier"] == "global"
    cfg = yaml.safe_load((ROOT / "config/experiments/fedpft.yaml").read_text())
    runs = {n: e for n, e in cfg["experiments"].items() if "fedpft" in e.get("methods", [])}
    assert len(runs) == 22
    for name, e in runs.items():
        fed, opt, part = e["federation"], e["optimizer"], e["partition"]
        rf = e["method_params"]["fedpft"]["feature_epochs"]
        assert rf == (3 if part.get("alpha") == 0.1 else 4), name
        assert (fed["local_epochs"], fed["batch_size"], fed["rounds"]) == (5, 100, 1000), name
        assert (opt["name"], opt["lr"]) == ("sgd", 0.1), name
        assert part["clients"] == (10 if name == "pft_c10_viz" else 40), name
        assert fed["participation"] == ({"9": 0.9, "7": 0.7, "5": 0.5}[name[-1]] if "_pp0p" in name else 1.0), name
        if part["scheme"] == "dirichlet_per_client" and name != "pft_c10_viz":   # §4.1: 500 train, 100 / 200 test
            assert (part["train_per_client"], part["test_per_client"]) == (500, 200 if "tiny" in name else 100), name
