"""pFedGate (FedPFT baseline): the block table and the knapsack selection against hand computations, the gated
forward equal to the model with block-scaled parameters, one joint step of model and gating layer written out,
evaluation's one knapsack on each client's mean gate score, and 2-round runs."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import identity, run_params
from fedcore.backbones.registry import build_backbone, prompt_adapter
from fedcore.engine.data import Batch
from fedcore.engine.optim import ClientData, TrainSettings
from fedcore.methods.pfedgate import PFedGate, block_table, min_factor, select_blocks
from fedcore.train import train_run

C = 4


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 2, bias=False)   # 12 weights
        self.fc = nn.Linear(3, 2)                    # 6 weights, 2 biases


def test_blocks_split_each_tensor_as_the_official_fine_grained_split():
    t = block_table(_Toy(), split=5)
    assert t.names == ("conv.weight", "fc.weight", "fc.bias")
    # 12 -> ceil(12/5) = 3 per block, 4 blocks; 6 -> 2 per block, 3 blocks; 2 (< 5) -> 2 blocks of 1
    assert t.sub_sizes == ((3, 3, 3, 3), (2, 2, 2), (1, 1))
    assert t.other == (1, 2, 3) and t.linear == (5, 6, 8)          # first block of each tensor left out
    lin = nn.Linear(5, 5)                                            # 25 weights at split 10: 9 blocks, last 1
    assert block_table(lin, 10).sub_sizes[0] == (3,) * 8 + (1,)
    assert min_factor(5, 0.5) == pytest.approx(0.2) and min_factor(20, 0.3) == pytest.approx(0.1)
    assert min_factor(5, 0.15) == pytest.approx(0.15)


def test_the_knapsack_keeps_the_highest_scored_blocks_within_the_sparsity_budget():
    t = block_table(_Toy(), split=5)
    scores = torch.tensor([.9, .31, .72, .55, .5, .26, .64, .5, .81])
    floor = min_factor(5, 0.5)                                       # 0.2
    # other blocks 1..3 (sizes 3, 3, 3): capacity round(9 * 0.3) = 3 -> the best one (block 2, value 7) only;
    # linear blocks 5, 6, 8 (sizes 2, 2, 1): capacity round(5 * 0.3) = 2 -> block 8 (value 8) fits, then 6
    # (value 6, size 2) does not, 5 (value 3, size 2) does not
    keep = torch.tensor([1, 0, 1, 0, 1, 0, 0, 1, 1.])
    assert torch.equal(select_blocks(scores, t, 0.5, floor), scores * keep)
    assert torch.equal(select_blocks(scores, t, 1.0, 0.2), scores)   # s = 1: every block, its score


def test_the_head_joins_no_knapsack_group_unless_prune_head():
    # FedPFT's extractor has no nn.Linear but its head: the official linear budget would prune class rows
    kept = _method().model.table
    head = [i for i, n in enumerate(kept.names) if n.startswith("head.")]
    first = [sum(len(s) for s in kept.sub_sizes[:i]) for i in range(len(kept.names))]
    head_blocks = {first[i] + j for i in head for j in range(len(kept.sub_sizes[i]))}
    assert kept.linear == () and not head_blocks & set(kept.other)
    literal = _method(prune_head=True).model.table
    assert set(literal.linear) == head_blocks - {first[i] for i in head}
    assert literal.other == kept.other
    # every head block keeps its (floored) score; under the literal rule some head row is zeroed
    scores = torch.full((len(kept.sizes),), 0.5)
    floor = min_factor(5, 0.5)
    w = select_blocks(scores, kept, 0.5, floor)
    assert all(w[b] == 0.5 for b in head_blocks)
    assert any(select_blocks(scores, literal, 0.5, floor)[b] == 0 for b in head_blocks)


def test_kept_blocks_weigh_their_unfloored_score_with_the_official_straight_through_gradient():
    """Official ``seperate_trans 0``: a kept block's weight is its score t (not max(t, floor)) times 1 − g.detach() + g
    with g = max(t, floor), so the gate's gradient is (1 + t)·∂t above the floor and ∂t below it."""
    model = _method().model
    n = len(model.table.sizes)
    t = torch.full((n,), 0.6)
    t[::3] = 0.05                                                    # below the floor (0.2)
    t.requires_grad_()
    w = model.select(t)
    kept = w.detach() != 0
    assert kept.any() and (~kept).any()
    torch.testing.assert_close(w.detach()[kept], t.detach()[kept])  # the value is t, below the floor too
    assert (t.detach()[kept] < model.floor).any()
    w.sum().backward()
    expected = torch.where(t.detach() > model.floor, 1 + t.detach(), torch.ones(n)) * kept
    torch.testing.assert_close(t.grad, expected)
    model.sparsity = 1.0                                             # s = 1: every block at t, no straight-through
    torch.testing.assert_close(model.select(t).detach(), t.detach())


def test_the_evaluation_gate_reads_the_clients_images_without_the_training_augmentation():
    """The engine's evaluation data augments its training batches (the experiment's augment); the client-level gate
    is scored on ``ClientData.plain``, the images as they are."""
    method = _method()
    model = method.model.eval()
    server = method.strategy.init_state(1)
    plain, noisy = _two_batches(), _two_batches()
    shifted = [b._replace(x=b.x.flip(-1)) for b in noisy.batches()]   # an "augmented" pass
    data = ClientData(0, 10, lambda: iter(shifted), noisy.generator, plain=plain.batches)
    method.evaluator.load(model, 0, server, method.client.init_state(0), data)
    with torch.no_grad():
        expected = model.block_weights(torch.cat([b.x for b in plain.batches()]))
        augmented = model.block_weights(torch.cat([b.x for b in shifted]))
    assert torch.allclose(model.fixed_weights, expected) and not torch.allclose(model.fixed_weights, augmented)


def _method(arch: str = "resnet8_pft_mini", **params) -> PFedGate:
    torch.manual_seed(0)
    return PFedGate(prompt_adapter(build_backbone(arch)), C, params)


def test_the_gated_forward_is_the_model_with_block_scaled_parameters():
    method = _method()
    model = method.model
    model.eval()
    x = torch.randn(3, 3, 16, 16)
    weights = torch.rand(len(model.table.sizes))
    model.mode, model.fixed_weights = "fixed", weights
    plain = copy.deepcopy(model)
    plain.mode = "none"
    with torch.no_grad():
        pos = 0
        for name, sizes in zip(model.table.names, model.table.sub_sizes, strict=True):
            p = dict(plain.named_parameters())[name]
            flat = torch.cat([weights[pos + i].repeat(s) for i, s in enumerate(sizes)])
            p.mul_(flat.reshape(p.shape))
            pos += len(sizes)
        assert torch.allclose(model(x), plain(x), atol=1e-5)
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith("gate.linear")) == \
        (3 * 16 * 16 + 1) * len(model.table.sizes)


def _data(n: int = 8) -> ClientData:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, 16, 16, generator=g), torch.randint(C, (n,), generator=g)
    return ClientData(0, n, lambda: iter([Batch(x, y, torch.arange(n), {})]), g)


def test_one_step_moves_model_and_gate_by_their_own_sgd_and_only_the_model_goes_up():
    method = _method(gate_lr=0.3, max_grad_norm=0.0)
    model, data = method.model, _data()
    batch = next(data.batches())
    ref = copy.deepcopy(model)
    ref.train()
    loss = F.cross_entropy(ref(batch.x), batch.y)
    names = [n for n, _ in ref.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(loss, list(ref.parameters())), strict=True))
    settings = TrainSettings(1, 8, {"name": "sgd", "lr": 0.1, "momentum": 0.0})
    model.train()
    state, res = method.client.fit(0, method.client.init_state(0), method.strategy.configure(
        method.strategy.init_state(1), 0), data, settings)
    after = dict(model.named_parameters())
    for n in names:
        p0 = dict(ref.named_parameters())[n].detach()
        if n.startswith("gate."):   # SGD lr 0.3, weight decay 5e-4 (first momentum step = the gradient)
            expected = p0 - 0.3 * (grads[n] + 5e-4 * p0)
        else:
            expected = p0 - 0.1 * grads[n]
        assert torch.allclose(after[n], expected, atol=1e-5), n
    assert set(res.uplink["model"]) == set(method.client.shared_keys(method.keys(0)))
    assert not any(k.startswith("gate.") for k in res.uplink["model"]) and "net.bn1.running_mean" in res.uplink["model"]
    assert set(state["model"]) == {k for k in method.keys(0) if k.startswith("gate.")}
    assert state["optimizer"]["state"]                               # the gate's momentum is kept


def _two_batches() -> ClientData:
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(6, 3, 16, 16, generator=g), 3 * torch.randn(4, 3, 16, 16, generator=g) + 1]
    bs = [Batch(x, torch.randint(C, (len(x),), generator=g), torch.arange(len(x)), {}) for x in xs]
    return ClientData(0, 10, lambda: iter(bs), g)


def test_evaluation_gates_each_client_by_one_knapsack_on_its_mean_eval_mode_score():
    method = _method()
    model = method.model.eval()
    server = method.strategy.init_state(2)
    data = _two_batches()
    other = dict(method.client.init_state(1)["model"])
    other["gate.linear.weight"] = other["gate.linear.weight"] + 0.5 * torch.randn_like(other["gate.linear.weight"])
    states = [method.client.init_state(0), {"model": other}]
    fixed = []
    for c in range(2):
        method.evaluator.load(model, c, server, states[c], data)
        assert model.mode == "fixed" and not model.gate.training
        with torch.no_grad():
            x = torch.cat([b.x for b in data.batches()])              # eval mode: per image, so one batch of all
            expected = model.block_weights(x)
            per_batch = [model.block_weights(b.x) for b in data.batches()]
        assert torch.allclose(model.fixed_weights, expected)
        # the batches keep different blocks, so averaging their kept weights would blend sub-models
        assert not torch.equal(per_batch[0] > 0, per_batch[1] > 0)
        assert not torch.allclose(model.fixed_weights, torch.stack(per_batch).mean(0))
        fixed.append(model.fixed_weights.clone())
    assert not torch.equal(fixed[0], fixed[1])
    method.evaluator.load(model, None, server, None, None)
    assert model.mode == "none"


@pytest.mark.parametrize("arch", ["resnet8_pft_mini", "resnet_mini_18"])
def test_two_rounds_average_the_model_and_keep_the_gates(hetero_files, tmp_path, arch):
    out = tmp_path / arch
    out.mkdir()
    params = {**run_params(rounds=2, participation=1.0), "method_params": {"sparsity": 0.5}}
    res = train_run(params, identity("pfedgate"), hetero_files["dataset"], hetero_files["partition5"], arch,
                    hetero_files["weights"].get(arch), out / "m.parquet", out / "f.pt", progress=False)
    assert not any(k.startswith("gate.") for k in res.global_state)
    gates = [res.personal_states[c]["gate.linear.weight"] for c in range(5)]
    assert all(not torch.equal(gates[0], g) for g in gates[1:])
    m = res.metrics
    acc = m[(m["round"] == 2) & (m.split == "local") & (m.metric == "acc")]
    assert len(acc) == 5 and acc["value"].between(0, 1).all()
    assert m[m.metric == "loss"]["value"].notna().all()
