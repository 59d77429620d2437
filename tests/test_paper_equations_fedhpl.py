"""FedHPL (arXiv:2405.17267) equation by equation: each paper formula written out by hand in plain torch on tiny
tensors and compared with what our code computes (fp32 on the CPU, deterministic).

Covered here (what tests/test_method_fedhpl.py does not already pin numerically):
* Eqs. 3, 5, 6 (VPT-deep) and Eq. 4 (VPT-shallow): the logits of our prompted classifier against a hand-run ViT
  ([cls, P_{a-1}, E] into block a, prompt outputs discarded in deep, carried in shallow; head on the final cls,
  after the backbone's final LayerNorm as documented in DEVIATIONS.md "FedHPL", Model).
* FedHPL (CNN): learnable pixels concatenated around the image, the frozen ResNet (BatchNorm on running stats),
  the head; the gradient reaches the pad pixels and the head only.
* Eqs. 1, 2, 9 through the client's own loss path (the teacher arriving by the server's downlink): value, and the
  gradients reaching each parameter group (prompts and head; nothing of the frozen backbone, no teacher gradient).
* Alg. 1's LocalTrain as a phase: per-batch mean of CE + γ·KL over two uneven batches, SGD (lr 0.01, momentum
  0.9, wd 1e-4) steps by hand, the optimiser state carried to the next round (documented choice, §1.7), then the
  upload pass: the raw logits of the *trained* model for the samples it predicts correctly, with their labels.
* Eq. 10: the "Average" uplink's per-class means and counts.
* Eqs. 7, 8 through the server role: β from the backbones' feature dims, p̃_{k,c} with the "+1", the mask of
  classes with a teacher, and the row each client receives (configure).
* Round order (Alg. 1): round 1 has no teacher (CE only, documented §8.2); the teacher of round r is the
  aggregate of round r-1's uploads.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo
from fedcore.methods.fedhpl import FedHPL, upload_average

C = 4                                     # classes
OPT = {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}   # the paper's SGD (§4 Impl. details)


# ---- helpers -------------------------------------------------------------------------------------------------
def _jitter(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Perturb a random-init backbone so that attention, LayerNorm and the cls token do real work (a planted layout
    bug then moves the logits visibly)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _method(archs: tuple[str, ...] = ("vit_mini_s",), client_backbones: list[int] | None = None, **params) -> FedHPL:
    """FedHPL around jittered random backbones (vit_mini_s: D = 32, 4 blocks, 4-px patches, 16-px images); prompts
    and head as the method builds them (the clients' initial state)."""
    torch.manual_seed(0)
    backbones = []
    for i, a in enumerate(archs):
        net = build_backbone(a)
        _jitter(net, 10 + i)
        backbones.append(prompt_adapter(net))
    return FedHPL(backbones, C, params, client_backbones=client_backbones or [0] * len(archs))


def _images(n: int, seed: int) -> Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _hand_vpt_logits(vit: torch.nn.Module, prompts: list[Tensor], w: Tensor, b: Tensor, x: Tensor,
                     deep: bool) -> Tensor:
    """Eqs. 3-6 by hand: E = L_E(x) with position encoding; block 1 reads [cls, P_0, E]; block a > 1 reads
    [cls_{a-1}, P_{a-1}, E_{a-1}] (deep, Eq. 5) or [cls_{a-1}, Z_{a-1}, E_{a-1}] (shallow, Eq. 4);
    p = H(LN(cls_N)) (the final LayerNorm: DEVIATIONS.md, FedHPL Model)."""
    bsz, n = x.shape[0], prompts[0].shape[0]
    patches = vit.patch_embed(x)                                              # (B, M, D)
    tok = torch.cat([vit.cls_token.expand(bsz, -1, -1), patches], 1) + vit.pos_embed   # cls and E: pos-emb
    cls, e = tok[:, :1], tok[:, 1:]
    z = prompts[0].expand(bsz, -1, -1)                                        # prompts: no pos-emb
    for a, blk in enumerate(vit.blocks):
        if a > 0 and deep:
            z = prompts[a].expand(bsz, -1, -1)                                # Z_{a-1} discarded (Eq. 5)
        out = blk(torch.cat([cls, z, e], 1))
        cls, z, e = out[:, :1], out[:, 1:1 + n], out[:, 1 + n:]
    return F.layer_norm(cls[:, 0], cls.shape[-1:], vit.norm.weight, vit.norm.bias, vit.norm.eps) @ w.T + b


def _hand_loss(logits: Tensor, y: Tensor, teacher: Tensor, mask: Tensor, gamma: float, temp: float) -> Tensor:
    """Alg. 1's batch loss, (1/bs)[Σ_i CE(p_i, y_i) + γ Σ_i ℓ^kd(p̃_{y_i}, p_i)], ℓ^kd = Eq. 9's
    KL(softmax(p̃/T) ‖ softmax(p/T)) = Σ_c q_c (log q_c - log s_c); a class without teacher: KL(s‖s) = 0 (C.4)."""
    bs = len(y)
    ce = -(logits - logits.logsumexp(1, keepdim=True))[torch.arange(bs), y]
    q = torch.exp(teacher[y] / temp) / torch.exp(teacher[y] / temp).sum(1, keepdim=True)
    log_s = logits / temp - (logits / temp).logsumexp(1, keepdim=True)
    kl = (q * (q.log() - log_s)).sum(1) * mask[y]
    return (ce.sum() + gamma * kl.sum()) / bs


def _server_state(method: FedHPL, k: int, seed: int, mask: list[float]) -> dict:
    """A server state holding a random p̃ (K, C, C) and which classes have one."""
    g = torch.Generator().manual_seed(seed)
    state = method.strategy.init_state(k)
    state["logits"] = torch.randn(k, C, C, generator=g) * 3
    state["mask"] = torch.tensor([mask] * k)
    return state


# ---- Eqs. 3-6: the prompted ViT -----------------------------------------------------------------------------
def test_eqs_3_to_6_vpt_deep_and_shallow_logits_equal_a_hand_run_vit():
    x = _images(5, 1)
    for depth, n_sets in (("deep", 4), ("shallow", 1)):
        method = _method(prompt_depth=depth, num_prompts=3)
        model = method.model_for(0).eval()
        vit = model.backbone.vit
        prompts = [model.prompts[i] for i in range(len(model.prompts))]
        assert len(prompts) == n_sets and all(p.shape == (3, 32) for p in prompts)  # P_k = {P_{k,a}}_{a<N_k}
        with torch.no_grad():
            want = _hand_vpt_logits(vit, prompts, model.head.weight, model.head.bias, x, deep=depth == "deep")
            got = model(x)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        assert want.std(0).mean() > 1e-2                                     # the logits really vary per image


def test_cnn_pixels_padded_around_the_image_then_frozen_resnet_then_head():
    import copy

    method = _method(("resnet_mini_18",))
    model = method.model_for(0)
    model.train()                                                           # BN must still use running stats
    pad = model.pad
    with torch.no_grad():
        pad.prompt_lr.normal_(0, 1, generator=torch.Generator().manual_seed(2))
        pad.prompt_tb.normal_(0, 1, generator=torch.Generator().manual_seed(3))
    x = _images(4, 2)
    # learnable pixels concatenated around the image (left/right s x w, top/bottom w x (s + 2w)); none overwritten
    mid = torch.cat([pad.prompt_lr[0].expand(4, -1, -1, -1), x, pad.prompt_lr[1].expand(4, -1, -1, -1)], 3)
    padded = torch.cat([pad.prompt_tb[0].expand(4, -1, -1, -1), mid, pad.prompt_tb[1].expand(4, -1, -1, -1)], 2)
    assert padded.shape == (4, 3, 22, 22)
    resnet = model.backbone.resnet
    stats = {k: v.clone() for k, v in resnet.state_dict().items() if "running" in k}
    frozen = copy.deepcopy(resnet).eval()                                   # BN on its running statistics (§8.11)
    want = frozen(padded) @ model.head.weight.T + model.head.bias
    got = model(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    got.logsumexp(1).sum().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained == {"pad.prompt_lr", "pad.prompt_tb", "head.weight", "head.bias"}
    assert all(torch.equal(v, resnet.state_dict()[k]) for k, v in stats.items())


# ---- Eqs. 1, 2, 9 through the client's loss ------------------------------------------------------------------
def test_eqs_1_2_9_client_loss_value_and_which_parameters_its_gradient_reaches():
    gamma, temp = 0.7, 2.5                                                   # not the defaults: both must be read
    method = _method(client_backbones=[0, 0, 0], gamma=gamma, temperature=temp)
    client, server = method.client, method.strategy
    cid, model = 2, method.model_for(2)
    state = _server_state(method, 3, seed=4, mask=[1.0, 1.0, 0.0, 1.0])     # class 2 has no teacher (C.4)
    client.start(model, cid, client.init_state(cid), server.configure(state, cid))
    model.train()
    x, y = _images(7, 5), torch.tensor([0, 1, 2, 3, 2, 1, 0])
    got = client.loss(model, Batch(x, y, torch.arange(7), {}))
    params = dict(model.named_parameters())
    prompts = [params[f"prompts.{i}"] for i in range(4)]
    logits = _hand_vpt_logits(model.backbone.vit, prompts, params["head.weight"], params["head.bias"], x, True)
    want = _hand_loss(logits, y, state["logits"][cid], state["mask"][cid], gamma, temp)   # client cid's row of p̃
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    ce_only = F.cross_entropy(logits, y)
    assert (want - ce_only).abs() > 1e-3                                    # the KD term is really there
    trainable = set(method.trainable_keys(cid))
    assert trainable == {*(f"prompts.{i}" for i in range(4)), "head.weight", "head.bias"}   # {P_k, θ_k} only
    grads = torch.autograd.grad(got, [params[k] for k in sorted(trainable)])
    hand = torch.autograd.grad(want, [params[k] for k in sorted(trainable)])
    for k, g, h in zip(sorted(trainable), grads, hand):
        torch.testing.assert_close(g, h, rtol=0, atol=1e-6, msg=k)
        assert g.abs().sum() > 0, k
    frozen = [p for n, p in params.items() if n not in trainable]
    assert frozen and not any(p.requires_grad for p in frozen)              # ω* frozen: no gradient reaches it
    assert not model.teacher.requires_grad and not model.teacher_mask.requires_grad   # p̃ is a constant


# ---- Alg. 1 LocalTrain + upload, as one phase -------------------------------------------------------------------
def _sgd_by_hand(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None]) -> list[Tensor]:
    """One SGD step with momentum and weight decay: d = g + wd·p; buf = d (first) or μ·buf + d; p -= lr·buf."""
    out = []
    for i, (p, g) in enumerate(zip(params, grads)):
        d = g + OPT["weight_decay"] * p
        bufs[i] = d.clone() if bufs[i] is None else OPT["momentum"] * bufs[i] + d
        out.append((p - OPT["lr"] * bufs[i]).detach().requires_grad_(True))
    return out


def test_alg1_local_train_then_upload_of_the_trained_models_correct_logits():
    gamma, temp = 1.0, 4.5                                                   # the paper's defaults
    method = _method()
    client, server = method.client, method.strategy
    cid, model = 0, method.model_for(0)
    vit = model.backbone.vit
    x, y = _images(8, 6), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    batches = [Batch(x[:5], y[:5], torch.arange(5), {}), Batch(x[5:], y[5:], torch.arange(5, 8), {})]  # uneven
    data = ClientData(cid, 8, lambda: iter(batches), torch.Generator().manual_seed(0),
                      plain=lambda: iter(batches))
    settings = TrainSettings(local_epochs=1, batch_size=5, optimizer=dict(OPT))
    keys = [*(f"prompts.{i}" for i in range(4)), "head.weight", "head.bias"]
    named = dict(model.named_parameters())
    hand = [named[k].detach().clone().requires_grad_(True) for k in keys]
    bufs: list[Tensor | None] = [None] * len(keys)
    backbone0 = {k: v.clone() for k, v in vit.state_dict().items()}
    state = client.init_state(cid)
    for rnd, mask in enumerate(([0.0] * C, [1.0, 0.0, 1.0, 1.0])):         # round 1: no teacher yet
        down_state = _server_state(method, 1, seed=7 + rnd, mask=mask)
        teacher, tmask = down_state["logits"][cid], down_state["mask"][cid]
        state, res = client.fit(cid, state, server.configure(down_state, cid), data, settings)
        for b in batches:                                                    # one SGD step per batch, by hand
            logits = _hand_vpt_logits(vit, hand[:4], hand[4], hand[5], b.x, True)
            loss = _hand_loss(logits, b.y, teacher, tmask, gamma, temp)
            hand = _sgd_by_hand(hand, list(torch.autograd.grad(loss, hand)), bufs)
        got = dict(model.named_parameters())
        for k, h in zip(keys, hand):
            torch.testing.assert_close(got[k].detach(), h.detach(), rtol=0, atol=1e-6,
                                       msg=lambda m, k=k: f"round {rnd + 1} {k}: {m}")
        assert all(torch.equal(v, vit.state_dict()[k]) for k, v in backbone0.items())   # ω* untouched
        # upload (Alg. 1's second loop): the trained model's raw logits of the correctly predicted samples
        with torch.no_grad():
            logits = _hand_vpt_logits(vit, hand[:4], hand[4], hand[5], x, True)
        keep = logits.argmax(1) == y
        assert 0 < int(keep.sum()) < len(y)                                  # some kept, some dropped
        assert set(res.uplink) == {"logits", "labels"}
        torch.testing.assert_close(res.uplink["logits"], logits[keep], rtol=0, atol=1e-5)
        assert torch.equal(res.uplink["labels"], y[keep])


# ---- Eq. 10: the "Average" uplink ----------------------------------------------------------------------------
def test_eq10_average_upload_is_the_per_class_mean_of_the_kept_logits_with_its_count():
    g = torch.Generator().manual_seed(8)
    logits, labels = torch.randn(9, C, generator=g) * 2, torch.tensor([0, 0, 1, 3, 3, 3, 0, 1, 3])
    up = upload_average(logits, labels, C)
    for c in range(C):
        rows = [logits[i] for i in range(9) if int(labels[i]) == c]
        assert int(up["counts"][c]) == len(rows)
        want = sum(rows) / len(rows) if rows else torch.zeros(C)            # class 2: none, mean unused
        torch.testing.assert_close(up["means"][c], want, rtol=0, atol=1e-6)
    # the client role sends exactly this for its correctly predicted samples
    method = _method(upload="Average")
    model = method.model_for(0).eval()
    x, y = _images(8, 6), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    data = ClientData(0, 8, lambda: iter([Batch(x, y, torch.arange(8), {})]), torch.Generator())
    with torch.no_grad():
        p = model(x)
    sent = method.client.upload(model, 0, data, {})
    keep = p.argmax(1) == y
    for c in range(C):
        sel = keep & (y == c)
        assert int(sent["counts"][c]) == int(sel.sum())
        if sel.any():
            torch.testing.assert_close(sent["means"][c], p[sel].mean(0), rtol=0, atol=1e-5)


# ---- Eqs. 7, 8 through the server role -------------------------------------------------------------------------
def test_eqs_7_8_server_aggregate_with_betas_from_the_backbone_dims_and_each_clients_row():
    # clients 0, 1, 2, 3 on backbones of dims 32, 64, 64, 80 (vit_mini_s, vit_mini, vit_mini, vit_mini_l)
    method = _method(("vit_mini_s", "vit_mini", "vit_mini_l"), client_backbones=[0, 1, 1, 2])
    dims = [32, 64, 64, 80]
    g = torch.Generator().manual_seed(9)
    ups = []
    for j, classes in enumerate(([0, 1], [0, 1, 2], [1], [0, 2])):          # nobody uploads class 3
        n = 3 + 2 * j
        lab = torch.tensor(classes)[torch.randint(len(classes), (n,), generator=g)]
        ups.append((torch.randn(n, C, generator=g) * 3, lab))
    results = [FitResult(j, 10 + j, {"logits": lg, "labels": lb}, {}) for j, (lg, lb) in enumerate(ups)]
    state = method.strategy.aggregate(RoundInfo(1, 4, 1.0, 0), method.strategy.init_state(4), results)
    for k in range(4):
        down = method.strategy.configure(state, k)["model"]
        for c in range(C):
            num, den = torch.zeros(C, dtype=torch.float64), 1.0                # "+1" in the denominator
            for j, (lg, lb) in enumerate(ups):
                beta = min(dims[k] / dims[j], dims[j] / dims[k])              # Eq. 7
                for p, yy in zip(lg.double(), lb.tolist()):
                    if yy == c:                                             # every uploaded class-c logit
                        num, den = num + beta * p, den + beta
            torch.testing.assert_close(down["teacher"][c].double(), num / den, rtol=0, atol=1e-5)
            assert float(down["teacher_mask"][c]) == (1.0 if den > 1.0 else 0.0)
    assert not torch.allclose(state["logits"][0], state["logits"][3])       # client-specific


# ---- round order (Alg. 1) ---------------------------------------------------------------------------------------
def test_round_r_distils_towards_the_aggregate_of_round_r_minus_1(tiny_run_files, tmp_path, monkeypatch):
    import fedcore.methods.base as base
    from fedcore.methods.fedhpl import FedHPLServer
    from fedcore.train import train_run

    seen: list[tuple[Tensor, Tensor]] = []
    aggregates: list[Tensor] = []
    kd, agg = base.kd_loss, FedHPLServer.aggregate

    def spy_kd(logits, labels, teacher, mask, gamma, temperature):
        seen.append((teacher.detach().clone(), mask.detach().clone()))
        return kd(logits, labels, teacher, mask, gamma, temperature)

    def spy_agg(self, info, state, results):
        new = agg(self, info, state, results)
        aggregates.append(new["logits"].clone())
        return new
    monkeypatch.setattr(base, "kd_loss", spy_kd)
    monkeypatch.setattr(FedHPLServer, "aggregate", spy_agg)
    params = {**run_params(rounds=2, participation=1.0), "method_params": {}}
    params["federation"]["batch_size"] = 64                                 # few steps: only the order matters
    train_run(params, identity("fedhpl"), tiny_run_files["dataset"], tiny_run_files["partition"], "vit_mini",
              tiny_run_files["weights"], tmp_path / "m.parquet", tmp_path / "f.pt", progress=False, device="cpu")
    half = len(seen) // 2                                                    # every client, both rounds, same steps
    assert half > 0 and len(aggregates) == 2
    assert all(not m.any() for _, m in seen[:half])                          # round 1: no teacher, CE only
    round2 = seen[half:]
    assert all(m.any() for _, m in round2)
    rows = aggregates[0].reshape(-1, C, C)
    assert all(any(torch.equal(t, r) for r in rows) for t, _ in round2)    # round 1's aggregate, a client's row
