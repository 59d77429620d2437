"""FedMix (Yoon et al., ICLR 2021, arXiv 2107.00233) equation by equation, each recomputed by hand in plain torch.

The paper's MAFL + FedMix (its Algorithm 1 and Sec. 3): every client k averages M_k local samples into
x̄ = (1/M_k) Σ x and ȳ = (1/M_k) Σ onehot(y) and sends them once; the server pools them (X_g, Y_g) and sends them
to the clients; the local loss is the first-order Taylor expansion of global Mixup
l((1-λ)x_i + λx_j, (1-λ)y_i + λy_j) around (1-λ)x_i, with the unknown raw x_j, y_j replaced by a mean:
    l1 = (1-λ) CE(f((1-λ)x_i), y_i),  l2 = λ CE(f((1-λ)x_i), ȳ_j),  l3 = λ <∂l1/∂x |_(1-λ)x_i, x̄_j>,
and the server averages the models as FedAvg. Ours trains VPT prompts + head (fedcore/methods/fedmix.py docstring,
DEVIATIONS "SGPT's other baselines"). The references below never call fedmix_loss's own arithmetic: a linear
model's input gradient in closed form, central differences for the directional derivative, and a per-sample loop.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fedcore.engine.optim import TrainSettings
from fedcore.engine.roles import FitResult, RoundInfo, module_state
from fedcore.methods.fedmix import client_means, fedmix_loss
from test_method_fedmix import _client as ordered_client, _method


# the unit tests' in-order client and method; the generator seeded 7 as these checks were written
_client = partial(ordered_client, seed=7)


class _Linear(nn.Module):
    """f(x) = W vec(x) + b: its input gradient of CE has a closed form, W^T (softmax(f) - y)."""

    def __init__(self, d: int, c: int, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, d, generator=gen) * 0.3)
        self.bias = nn.Parameter(torch.randn(c, generator=gen) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1) @ self.weight.T + self.bias


def test_loss_and_its_gradients_equal_the_closed_form_on_a_linear_model():
    """Every term and every parameter gradient of l1 + l2 + l3 by hand (no autograd): with z = W x' + b,
    x' = (1-λ)x_i, p = softmax(z): ∂CE(z, y)/∂x' = W^T (p - y), so l3_i = λ(1-λ) (W x̄_j)·(p - y_i);
    ∂l3/∂z = λ(1-λ) J u with u = W x̄_j and J = diag(p) - p p^T (softmax Jacobian), ∂l3/∂W also has
    λ(1-λ) (p - y) x̄^T from the u inside. The batch loss is the mean over samples. (Reference in float64; ours
    casts the logits to float32, hence the 1e-6 tolerances.)"""
    g = torch.Generator().manual_seed(11)
    lam, n, c = 0.2, 5, 4
    model = _Linear(3 * 2 * 2, c, g).double()
    x = torch.randn(n, 3, 2, 2, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 3, 1, 1, 2])
    xm = torch.randn(n, 3, 2, 2, generator=g, dtype=torch.float64)
    ym = torch.softmax(torch.randn(n, c, generator=g, dtype=torch.float64), 1)  # soft mean labels

    loss = fedmix_loss(model, x, y, xm, ym, lam)
    gw, gb = torch.autograd.grad(loss, [model.weight, model.bias])

    W, b = model.weight.detach(), model.bias.detach()
    xs, xbar = (1 - lam) * x.flatten(1), xm.flatten(1)
    z = xs @ W.T + b
    p = torch.softmax(z, 1)
    logp = torch.log_softmax(z, 1)
    oh = F.one_hot(y, c).double()
    l1 = (1 - lam) * -(oh * logp).sum(1)
    l2 = lam * -(ym * logp).sum(1)
    u = xbar @ W.T                                   # W x̄_j per sample
    l3 = lam * (1 - lam) * (u * (p - oh)).sum(1)    # λ <∂l1/∂x, x̄_j> with ∂l1/∂x = (1-λ) W^T (p - y)
    ref = (l1 + l2 + l3).mean()
    assert torch.allclose(loss, ref, atol=1e-6, rtol=1e-6)

    jac_u = p * u - p * (p * u).sum(1, keepdim=True)  # (diag(p) - p p^T) u, row by row
    dz = ((1 - lam) * (p - oh) + lam * (p - ym) + lam * (1 - lam) * jac_u) / n
    ref_gw = dz.T @ xs + lam * (1 - lam) * (p - oh).T @ xbar / n
    ref_gb = dz.sum(0)
    assert torch.allclose(gw, ref_gw, atol=1e-6, rtol=1e-5)
    assert torch.allclose(gb, ref_gb, atol=1e-6, rtol=1e-5)


def test_input_derivative_term_on_the_vit_equals_central_differences_per_sample():
    """On our prompted ViT, l3_i = λ <∂l1_i/∂x, x̄_j> taken at (1-λ)x_i is the directional derivative of l1_i along
    x̄_j: (l1_i(x' + h x̄) - l1_i(x' - h x̄)) / 2h, one sample at a time (no double backward, no batch trick). Its
    gradients on the prompts and on the head are the same difference of first-order parameter gradients."""
    m = _method()
    model = m.model.double()
    g = torch.Generator().manual_seed(12)
    lam, n, h = 0.1, 3, 1e-4
    x = torch.randn(n, 3, 16, 16, generator=g, dtype=torch.float64)
    y = torch.tensor([2, 0, 3])
    xm = torch.randn(n, 3, 16, 16, generator=g, dtype=torch.float64)
    ym = torch.softmax(torch.randn(n, 4, generator=g, dtype=torch.float64), 1)
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    assert names == ["prompts.0", "head.weight", "head.bias"]

    def l1(xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return (1 - lam) * F.cross_entropy(model(xi), yi)

    loss = fedmix_loss(model, x, y, xm, ym, lam)
    grads = torch.autograd.grad(loss, params)

    total = torch.zeros((), dtype=torch.float64)
    ref_grads = [torch.zeros_like(p) for p in params]
    for i in range(n):
        xi, yi, xb = (1 - lam) * x[i:i + 1], y[i:i + 1], xm[i:i + 1]
        with torch.no_grad():
            logits = model(xi)
            d = (l1(xi + h * xb, yi) - l1(xi - h * xb, yi)) / (2 * h)
            term = l1(xi, yi) + lam * F.cross_entropy(logits, ym[i:i + 1]) + lam * d
        total += term / n
        gp = torch.autograd.grad(l1(xi + h * xb, yi), params)
        gm = torch.autograd.grad(l1(xi - h * xb, yi), params)
        g12 = torch.autograd.grad(l1(xi, yi) + lam * F.cross_entropy(model(xi), ym[i:i + 1]), params)
        for r, a, bp, bm in zip(ref_grads, g12, gp, gm):
            r += (a + lam * (bp - bm) / (2 * h)) / n
    assert torch.allclose(loss, total, atol=1e-6, rtol=1e-6)
    for name, a, r in zip(names, grads, ref_grads):
        assert torch.allclose(a, r, atol=1e-6, rtol=1e-5), name
    assert grads[0].abs().sum() > 0  # l3 reaches the prompt through the double backward


def test_one_drawn_mean_per_sample_is_unbiased_for_the_papers_average_over_means():
    """The paper averages the loss over the global means j; ours draws one j per sample. l2 is linear in ȳ and l3 in
    x̄, so the average over every j equals the loss against the mean of the pool: our draw estimates it unbiased."""
    g = torch.Generator().manual_seed(13)
    model = _Linear(12, 4, g).double()
    lam, n, pool = 0.1, 4, 3
    x = torch.randn(n, 3, 2, 2, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3])
    X = torch.randn(pool, 3, 2, 2, generator=g, dtype=torch.float64)
    Y = torch.softmax(torch.randn(pool, 4, generator=g, dtype=torch.float64), 1)
    every = torch.stack([fedmix_loss(model, x, y, X[j].expand_as(x), Y[j].expand(n, 4), lam) for j in range(pool)])
    pooled = fedmix_loss(model, x, y, X.mean(0).expand_as(x), Y.mean(0).expand(n, 4), lam)
    assert torch.allclose(every.mean(), pooled, atol=1e-12)


def test_mean_data_are_exact_group_averages_with_a_soft_label_histogram():
    """x̄ = (1/M_k) Σ_{m ≤ M_k} x_m and ȳ = (1/M_k) Σ onehot(y_m) over consecutive groups of the seeded order; with
    M_k = 4 and 9 samples: 2 groups, the 9th dropped; the labels of each group form a histogram that sums to 1."""
    x = torch.linspace(-1, 1, 9 * 3 * 2 * 2).view(9, 3, 2, 2)
    y = torch.tensor([1, 1, 0, 3, 2, 2, 2, 0, 1])
    xm, ym = client_means(_client(x, y, batch=3), num_classes=4, mean_batch=4)
    ref_x = torch.stack([x[0:4].sum(0) / 4, x[4:8].sum(0) / 4])
    ref_y = torch.tensor([[0.25, 0.5, 0.0, 0.25], [0.25, 0.0, 0.75, 0.0]])
    assert torch.allclose(xm, ref_x, atol=1e-7) and torch.equal(ym, ref_y)


def test_a_local_round_is_sgd_on_the_fedmix_loss_with_means_drawn_from_the_clients_generator():
    """One FedMix client round by hand: batches of 3 in order, per batch j ~ U{0..|pool|-1} per sample from the
    client's generator, loss = mean_i [l1 + l2 + l3] with l3 from each sample's own input gradient (a loop), plain
    SGD on prompts + head only; the frozen backbone does not move and the uplink is exactly the trained tensors."""
    m = _method()
    g = torch.Generator().manual_seed(14)
    x, y = torch.randn(6, 3, 16, 16, generator=g), torch.tensor([0, 1, 2, 3, 0, 1])
    X = torch.randn(5, 3, 16, 16, generator=g)
    Y = torch.softmax(torch.randn(5, 4, generator=g), 1)
    lam, lr = 0.1, 0.5
    downlink = {"model": module_state(m.model, m.trainable_keys(0)), "fedmix_x": X.half(), "fedmix_y": Y}
    Xf = X.half().float()  # the pool travels as float16 (documented); the client computes in float32

    # reference: a fresh copy of the same model, trained by hand
    ref = _method().model
    ref.load_state_dict(m.model.state_dict())
    params = [p for p in ref.parameters() if p.requires_grad]
    frozen = {k: v.clone() for k, v in ref.state_dict().items() if k not in m.trainable_keys(0)}
    gen = torch.Generator().manual_seed(7)
    for s in (0, 3):
        xb, yb = x[s:s + 3], y[s:s + 3]
        j = torch.randint(5, (3,), generator=gen)
        loss = torch.zeros(())
        for i in range(3):
            xi = ((1 - lam) * xb[i:i + 1]).requires_grad_(True)
            with sdpa_kernel(SDPBackend.MATH):  # a double backward needs the math attention kernel
                logits = ref(xi)
            l1 = (1 - lam) * F.cross_entropy(logits, yb[i:i + 1])
            l2 = lam * F.cross_entropy(logits, Y[j[i]:j[i] + 1])
            (gx,) = torch.autograd.grad(l1, xi, create_graph=True)
            loss = loss + (l1 + l2 + lam * (gx * Xf[j[i]]).sum()) / 3
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, gp in zip(params, grads):
                p -= lr * gp

    _, result = m.client.fit(0, m.client.init_state(0), downlink, _client(x, y, batch=3),
                             TrainSettings(1, 3, {"name": "sgd", "lr": lr}))
    after = dict(m.model.state_dict())
    for k in m.trainable_keys(0):
        assert torch.allclose(after[k], dict(ref.named_parameters())[k], atol=2e-6, rtol=1e-5), k
        assert torch.equal(result.uplink["model"][k], after[k])
    assert set(result.uplink["model"]) == set(m.trainable_keys(0))  # no means or frozen weights go up each round
    assert all(torch.equal(after[k], v) for k, v in frozen.items())
    assert result.num_samples == 6


def test_server_is_fedavg_by_sample_count_and_keeps_the_pooled_means_for_every_round():
    """Server: w = Σ_k n_k w_k / Σ_k n_k over the round's uplinks (FedAvg); the pool X_g, Y_g built once in setup
    (client order, every client's own means included) stays in the state and goes out in every later downlink."""
    m = _method(mean_batch=0)
    g = torch.Generator().manual_seed(15)
    xs = [torch.randn(n, 3, 16, 16, generator=g) for n in (3, 5)]
    ys = [torch.randint(0, 4, (n,), generator=g) for n in (3, 5)]
    state = m.strategy.init_state(2)
    ups = [FitResult(c, len(ys[c]), m.client.setup(c, _client(xs[c], ys[c], batch=2, cid=c)), {}) for c in (0, 1)]
    m.strategy.setup(state, ups)
    pool_x = torch.stack([xs[0].mean(0), xs[1].mean(0)])
    pool_y = torch.stack([F.one_hot(ys[c], 4).float().mean(0) for c in (0, 1)])
    assert torch.allclose(state["fedmix_x"].float(), pool_x, atol=2e-3) and torch.allclose(state["fedmix_y"], pool_y)

    keys = m.trainable_keys(0)
    models = [{k: torch.randn(v.shape, generator=g) for k, v in state["model"].items()} for _ in range(2)]
    results = [FitResult(0, 3, {"model": models[0]}, {}), FitResult(1, 5, {"model": models[1]}, {})]
    new = m.strategy.aggregate(RoundInfo(1, 2, 1.0, 0), state, results)
    for k in keys:
        assert torch.allclose(new["model"][k], (3 * models[0][k] + 5 * models[1][k]) / 8, atol=1e-6), k
    down = m.strategy.configure(new, 1)
    assert torch.equal(down["fedmix_x"], state["fedmix_x"]) and torch.equal(down["fedmix_y"], state["fedmix_y"])
    assert all(torch.equal(down["model"][k], new["model"][k]) for k in keys)
