"""FedMD (Li & Wang, arXiv:1910.03581) and FedHE (Chan & Ngai, MSN 2021, arXiv:2110.09910) step by step: each step
of the original algorithm written out by hand in plain torch on tiny tensors and compared with our code (fp32 on the
CPU, deterministic). The network's forward pass is the oracle (a deep copy of the client's model); every loss,
target, label offset, optimiser step, phase order, uplink and aggregate is hand-written here.

FedMD, Algorithm 1 ("Transfer learning: Each party trains f_k to convergence on the public D_0 and then on its
private D_k ... Communicate: Each party computes the class scores f_k(x_i^0) on the public dataset ... Aggregate:
f̃(x^0) = 1/m Σ_k f_k(x^0) ... Digest: Each party trains its model f_k to approach the consensus f̃ on the public
dataset D_0. Revisit: Each party trains its model f_k on its own private data for a few epochs."), as our
DEVIATIONS.md "FedMD" places it in the engine's rounds. Not pinned before (tests/test_method_fedmd.py pins the
digest/consensus formulas on tensors, the server's subset and mean, the phase order by spies and the sizes):
* transfer learning: CE on every public sample with the label shifted after the n_c private classes;
* digest: mean |f_k(x) - f̃(x)| of every output (the official code's mean_absolute_error; the paper only says
  "approach the consensus") on the rows the consensus was computed on, row-aligned under the shuffle;
* revisit: CE on the private data; each phase with a fresh optimiser (documented);
* communicate: the raw logits ("without applying the softmax", supplementary "Method" 1), eval mode, of all
  n_c + n_p outputs, on the round's public rows in order; the server's consensus of two real clients' uploads;
* a client's two fits: round 1 = transfer learning -> revisit -> upload, round 2 = digest -> revisit -> upload;
* evaluation: argmax over all n_c + n_p outputs (a public-class answer counts as wrong).

FedHE: the paper's text could not be read here; the steps follow the authors' own TensorFlow code (github
ChanYunHin/FedHe, its client's distillation term: α·MSE(global logit of the class, raw logits), α = 1), our
docstring/DEVIATIONS ("FedHE") and the spec (per-class average logits up, global per-class logits down). The
authors' code also differs in ways these tests do not assert (documented): its uplink averages the train-mode
logits of the local steps, and its server is asynchronous. Not pinned before (tests/test_method_fedhe.py pins
kd_loss, class_means and aggregate_logits on tensors and the shapes of a run):
* a client's local training with the downlink's teacher: CE + γ·mean_i mask[y_i]·mean_c (t_{y_i,c} − p_ic)² per
  batch (the default, ``distill: mse``), or CE + γ·KL(softmax(t_y/T) ‖ softmax(p/T)) (``distill: kl``), SGD steps
  by hand, the gradient reaching every parameter of the entire model and no teacher buffer;
* the uplink: per-class mean of the trained model's eval-mode logits over its train set, and the counts;
* a round: round 1 CE only (no global logits), round 2 distils towards the aggregate of round 1's uploads.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.data.arrays import ArrayDataset
from fedcore.engine.data import Batch, DeviceSplit, InputPipeline
from fedcore.engine.evaluate import predict
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import ExtraData, RoundInfo, load_state
from fedcore.methods.fedhe import FedHE
from fedcore.methods.fedmd import FedMD

C, P = 3, 10                              # private classes, public classes (FedMD's n_p = 10)
OPT = {"name": "sgd", "lr": 0.01, "momentum": 0.9}
ARCHS = ("resnet_mini_18", "resnet_mini_34")


# ---- helpers ---------------------------------------------------------------------------------------------------
def _sgd(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None]) -> None:
    """torch's SGD with momentum (no dampening, no weight decay), by hand, in place."""
    with torch.no_grad():
        for i, (p, g) in enumerate(zip(params, grads)):
            bufs[i] = g.clone() if bufs[i] is None else OPT["momentum"] * bufs[i] + g
            p.sub_(OPT["lr"] * bufs[i])


def _phase(hand: nn.Module, batches: list[tuple[Tensor, Tensor | None]], loss_fn) -> None:
    """One phase by hand: a fresh optimiser (new momentum buffers), one SGD step per batch of ``loss_fn(out, y)``."""
    params = list(hand.parameters())
    bufs: list[Tensor | None] = [None] * len(params)
    hand.train()
    for x, y in batches:
        loss = loss_fn(hand(x).float(), y)
        _sgd(params, list(torch.autograd.grad(loss, params)), bufs)


def _assert_same(model: nn.Module, hand: nn.Module, what: str, atol: float = 2e-5) -> None:
    got, want = dict(model.named_parameters()), dict(hand.named_parameters())
    assert got.keys() == want.keys()
    for k in got:
        torch.testing.assert_close(got[k].detach(), want[k].detach(), rtol=0, atol=atol,
                                   msg=lambda m, k=k: f"{what} {k}: {m}")


def _private(n: int, seed: int, classes: int = C) -> tuple[Tensor, Tensor, list[Batch], ClientData]:
    """n private 16-px images (model-ready), labels cycling over the classes, two uneven batches, fixed order."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, 16, 16, generator=g), torch.arange(n) % classes
    cut = n // 2 + 1
    batches = [Batch(x[:cut], y[:cut], torch.arange(cut), {}), Batch(x[cut:], y[cut:], torch.arange(cut, n), {})]
    data = ClientData(seed, n, lambda: iter(batches), torch.Generator().manual_seed(seed),
                      plain=lambda: iter(batches))
    return x, y, batches, data


# ---- FedMD -----------------------------------------------------------------------------------------------------
PIPE = InputPipeline(16, (0.5,) * 3, (0.5,) * 3)


def _fedmd(**params) -> tuple[FedMD, Tensor, Tensor]:
    """FedMD over two random mini ResNets with a 12-image public set (labels 0..9, 0, 1); returns the method and
    the public set as model inputs (in row order) and labels."""
    torch.manual_seed(0)
    method = FedMD([prompt_adapter(build_backbone(a)) for a in ARCHS], C,
                   {"init": "random", "public": "digits_public", "pretrain_epochs": 1, **params},
                   client_backbones=[0, 1])
    rng = np.random.default_rng(3)
    pub = ArrayDataset(rng.integers(0, 256, (12, 16, 16, 3), dtype=np.uint8), np.arange(12) % P)
    split = DeviceSplit.from_arrays(pub, torch.device("cpu"))
    method.attach_dataset("public", ExtraData(split, P, PIPE))
    return method, PIPE(split.x), split.y


def _fresh(method, cid: int) -> tuple[dict, nn.Module, nn.Module]:
    """Client ``cid``'s initial state, its model loaded with it in train mode (as the engine hands it to ``fit``),
    and a hand copy."""
    state = method.client.init_state(cid)
    model = method.model_for(cid).train()
    load_state(model, state["model"])
    return state, model, copy.deepcopy(model)


def test_fedmd_transfer_learning_is_ce_on_the_public_set_with_labels_after_the_private_classes():
    method, x_pub, y_pub = _fedmd()
    _, model, hand = _fresh(method, 0)
    _, _, _, data = _private(7, 1)
    settings = TrainSettings(local_epochs=1, batch_size=16, optimizer=dict(OPT))     # the 12 rows in one batch
    params = list(model.parameters())
    loss = method.client.pretrain(model, params, data, settings)
    with torch.no_grad():
        want = F.cross_entropy(hand.train()(x_pub), y_pub + C)
    assert abs(loss - float(want)) < 1e-5                         # the reported loss is the first (only) step's
    _phase(hand, [(x_pub, y_pub + C)], lambda out, y: F.cross_entropy(out, y))   # public class j -> output n_c + j
    _assert_same(model, hand, "transfer learning")


def test_fedmd_digest_fits_the_consensus_by_mean_absolute_error_on_its_own_rows():
    method, x_pub, _ = _fedmd()
    _, model, hand = _fresh(method, 1)
    _, _, _, data = _private(7, 2)
    settings = TrainSettings(local_epochs=1, batch_size=16, optimizer=dict(OPT))
    rows = torch.tensor([1, 4, 5, 8, 10])                        # the round's public subset d_j (sorted)
    consensus = torch.randn(len(rows), C + P, generator=torch.Generator().manual_seed(4)) * 3
    down = {"consensus": consensus, "consensus_index": rows}
    loss = method.client.digest(model, list(model.parameters()), down, data, settings)
    mae = lambda out, t: (out - t).abs().sum() / t.numel()        # noqa: E731  mean over samples x outputs
    with torch.no_grad():
        assert abs(loss - float(mae(hand.train()(x_pub[rows]), consensus))) < 1e-5
    _phase(hand, [(x_pub[rows], consensus)], mae)                # row i of f̃ belongs to public row rows[i]
    _assert_same(model, hand, "digest")


def test_fedmd_a_clients_two_fits_and_the_servers_consensus_of_their_raw_eval_logits():
    method, x_pub, y_pub = _fedmd(public_subset=5)
    client, server = method.client, method.strategy
    settings = TrainSettings(local_epochs=2, batch_size=16, optimizer=dict(OPT))     # revisit: 2 epochs
    sstate = server.init_state(2)
    states, hands, datas = {}, {}, {}
    for cid in (0, 1):
        states[cid], _, hands[cid] = _fresh(method, cid)
        datas[cid] = _private(16 + cid, 10 + cid)
    ce = lambda out, y: F.cross_entropy(out, y)                  # noqa: E731
    mae = lambda out, t: (out - t).abs().sum() / t.numel()       # noqa: E731
    for rnd in (1, 2):
        info = RoundInfo(rnd, 2, 1.0, 5)
        assert server.select(info, sstate) == [0, 1]
        rows = sstate["upload_index"]
        assert len(rows) == 5 and torch.equal(rows, server.subset(info))
        consensus, crows = sstate["consensus"].clone(), sstate["consensus_index"].clone()
        results = []
        for cid in (0, 1):
            x, y, batches, data = datas[cid]
            states[cid], res = client.fit(cid, states[cid], server.configure(sstate, cid), data, settings)
            results.append(res)
            hand = hands[cid]
            if rnd == 1:                                          # transfer learning, then the private data
                assert len(crows) == 0
                _phase(hand, [(x_pub, y_pub + C)], ce)
            else:                                                 # digest the previous round's consensus
                _phase(hand, [(x_pub[crows], consensus)], mae)
            _phase(hand, [(b.x, b.y) for b in batches] * 2, ce)   # revisit: 2 epochs, one optimiser
            _assert_same(method.model_for(cid), hand, f"round {rnd} client {cid}")
            with torch.no_grad():                                 # communicate: raw logits, eval mode, in order
                want = hand.eval()(x_pub[rows])
            assert set(res.uplink) == {"logits", "index"} and torch.equal(res.uplink["index"], rows)
            torch.testing.assert_close(res.uplink["logits"], want, rtol=0, atol=2e-5)
            assert res.uplink["logits"].shape == (5, C + P)
        sstate = server.aggregate(info, sstate, results)
        torch.testing.assert_close(sstate["consensus"],              # f̃ = 1/m Σ_k f_k, m = 2
                                   (results[0].uplink["logits"] + results[1].uplink["logits"]) / 2,
                                   rtol=0, atol=1e-6)
        assert torch.equal(sstate["consensus_index"], rows)
    assert all(s["transferred"] for s in states.values())


def test_fedmd_is_scored_by_argmax_over_private_and_public_outputs():
    method, x_pub, _ = _fedmd()
    _, model, _ = _fresh(method, 0)
    with torch.no_grad():
        model.head.bias.zero_()
        model.head.bias[C + 2] = 1e4                             # public class 2 wins everywhere
    images = np.zeros((4, 16, 16, 3), dtype=np.uint8)
    split = DeviceSplit.from_arrays(ArrayDataset(images, np.arange(4) % C), torch.device("cpu"))
    model.eval()
    pred = predict(method, model, split, torch.arange(4), PIPE, 4)
    assert pred.tolist() == [C + 2] * 4                          # not clipped to the n_c private outputs
    assert (pred == split.y).float().mean() == 0                 # a public-class answer is an error


# ---- FedHE -----------------------------------------------------------------------------------------------------
def _fedhe(**params) -> FedHE:
    torch.manual_seed(0)
    return FedHE([prompt_adapter(build_backbone(a)) for a in ARCHS], C, {"init": "random", **params},
                 client_backbones=[0, 1])


def _hand_kd(out: Tensor, y: Tensor, teacher: Tensor, mask: Tensor, gamma: float, temp: float) -> Tensor:
    """CE + γ · mean_i mask[y_i] · Σ_c q_ic (log q_ic − log s_ic), q = softmax(t_{y_i}/T), s = softmax(p_i/T)."""
    q = torch.exp(teacher[y] / temp) / torch.exp(teacher[y] / temp).sum(1, keepdim=True)
    log_s = out / temp - torch.logsumexp(out / temp, 1, keepdim=True)
    kl = (q * (q.log() - log_s)).sum(1) * mask[y]
    return -(out.log_softmax(1)[torch.arange(len(y)), y]).mean() + gamma * kl.sum() / len(y)


def _hand_mse(out: Tensor, y: Tensor, teacher: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """CE + γ · (1/B) Σ_i mask[y_i] · (1/C) Σ_c (t_{y_i,c} − p_ic)² (Keras' MeanSquaredError, the authors' client)."""
    se = torch.zeros(())
    for i in range(len(y)):
        se = se + mask[y[i]] * sum((teacher[y[i], c] - out[i, c]) ** 2 for c in range(out.shape[1])) / out.shape[1]
    return -(out.log_softmax(1)[torch.arange(len(y)), y]).mean() + gamma * se / len(y)


def _hand_distill(distill: str, gamma: float, temp: float):
    """The hand-written loss of ``distill`` (mse: raw logits; kl: softened by T)."""
    if distill == "mse":
        return lambda out, y, teacher, mask: _hand_mse(out, y, teacher, mask, gamma)
    return lambda out, y, teacher, mask: _hand_kd(out, y, teacher, mask, gamma, temp)


@pytest.mark.parametrize("distill", ["mse", "kl"])
def test_fedhe_local_training_distils_towards_the_teacher_and_trains_the_entire_model(distill):
    gamma, temp = 0.7, 2.0
    method = _fedhe(gamma=gamma, temperature=temp, distill=distill)
    hand_loss = _hand_distill(distill, gamma, temp)
    client, cid = method.client, 1
    state, model, hand = _fresh(method, cid)
    x, y, batches, data = _private(9, 20)
    teacher = torch.randn(C, C, generator=torch.Generator().manual_seed(21)) * 3
    mask = torch.tensor([1.0, 0.0, 1.0])                          # class 1: no global logit (CE only)
    down = {"model": {"teacher": teacher, "teacher_mask": mask}}
    # the loss through the client's own path and which parameters its gradient reaches
    client.start(model, cid, state, down)
    model.train()
    ours = client.loss(model, batches[0])
    want = hand_loss(hand.train()(batches[0].x), batches[0].y, teacher, mask)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)
    named = dict(model.named_parameters())
    grads = torch.autograd.grad(ours, list(named.values()), allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)   # backbone and head: the entire model
    assert not model.teacher.requires_grad and "teacher" not in named
    # a fit: one SGD step per batch by hand, then the uplink of the trained model (both from the initial state
    # again: the forward above moved the BatchNorm statistics)
    load_state(model, state["model"])
    hand = copy.deepcopy(model)
    settings = TrainSettings(local_epochs=1, batch_size=5, optimizer=dict(OPT))
    state, res = client.fit(cid, state, down, data, settings)
    _phase(hand, [(b.x, b.y) for b in batches], lambda out, t: hand_loss(out, t, teacher, mask))
    _assert_same(method.model_for(cid), hand, "fedhe fit")
    with torch.no_grad():
        logits = hand.eval()(x)                                   # one eval-mode pass after training
    for c in range(C):
        rows = [logits[i] for i in range(len(y)) if int(y[i]) == c]
        torch.testing.assert_close(res.uplink["logits"][c], sum(rows) / len(rows), rtol=0, atol=2e-5)
        assert int(res.uplink["counts"][c]) == len(rows)
    assert set(res.uplink) == {"logits", "counts"}


def test_fedhe_round_1_is_ce_only_and_round_2_distils_towards_round_1s_aggregate():
    method = _fedhe()                                             # γ = 1, MSE on raw logits (defaults)
    client, server = method.client, method.strategy
    settings = TrainSettings(local_epochs=1, batch_size=5, optimizer=dict(OPT))
    sstate = server.init_state(2)
    states, hands, datas = {}, {}, {}
    for cid in (0, 1):
        states[cid], _, hands[cid] = _fresh(method, cid)
        datas[cid] = _private(8 + cid, 30 + cid)
    for rnd in (1, 2):
        teacher, tmask = sstate["logits"].clone(), sstate["mask"].clone()
        assert (tmask.sum() == 0) == (rnd == 1)
        results = []
        for cid in (0, 1):
            x, y, batches, data = datas[cid]
            states[cid], res = client.fit(cid, states[cid], server.configure(sstate, cid), data, settings)
            results.append(res)
            if rnd == 1:
                loss = lambda out, t: F.cross_entropy(out, t)     # noqa: E731
            else:
                loss = lambda out, t: _hand_mse(out, t, teacher, tmask, 1.0)  # noqa: E731
            _phase(hands[cid], [(b.x, b.y) for b in batches], loss)
            _assert_same(method.model_for(cid), hands[cid], f"round {rnd} client {cid}")
        sstate = server.aggregate(RoundInfo(rnd, 2, 1.0, 0), sstate, results)
        # global logit of class c: the plain mean of the two clients' class-c means (both hold every class)
        want = (results[0].uplink["logits"] + results[1].uplink["logits"]) / 2
        torch.testing.assert_close(sstate["logits"], want, rtol=0, atol=1e-6)
        assert torch.equal(sstate["mask"], torch.ones(C))
