"""A round's clients in one pass through the frozen backbone, without vmap.

Clients that share a frozen backbone and differ only in small tensors (prompts, heads, keys, text contexts, a
teacher's logits) train together by concatenating their batches: per step, one forward and one backward of the
frozen backbone for every client that still has a batch, a plain batch through the fused attention kernels (vmap
over attention fails on CUDA). The per-client tensors are stacked on a leading client axis (C, ...) and swapped
into the model (``functional_call``); its forward reads them through :class:`Owners`, which knows which client
each segment of the concatenated batch belongs to: ``expand`` broadcasts each client's prompt over its own samples,
``linear`` runs each segment through its client's head, ``of`` gives each segment's client row of any stacked
tensor. The loss returns each client's loss (its own loss on its own segment); the step's objective is their sum,
so the gradient at client c's rows is exactly c's gradient (no other client's loss reaches them).

The optimiser is torch's single-tensor SGD / Adam / AdamW (torch.optim's CPU default), replayed per client row
with the same operations on row views of the stacked tensors (``torch._foreach_*``: per tensor on the CPU, fused
on CUDA), and only on the rows of the step's active clients; a client's kept optimiser state (``keep_optimizer``)
is read from and written back to torch's ``state_dict`` format.

Equality with one by one: each client draws its batches from its own stream in its own order and takes one step
per batch; a client with fewer batches drops out, so it takes no later step (as its own update ends there); its
optimiser state is its own rows. Every operation a client's numbers go through has the shapes of its one-by-one
update (each segment's loss, head and prompt broadcast is computed on its own segment) except the frozen
backbone's, which runs on the concatenated batch: row for row the same arithmetic where its kernels do not
depend on the batch size (CPU, tests/test_onepass.py: bit for bit in fp32), float reassociation where they do.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from fedcore.engine.optim import OptimizerSpec, make_optimizer, optimizer_spec
from fedcore.engine.precision import autocast_for

_END = object()
#: the open evaluation scope's cache of batch-invariant work (see ``batch_invariant``); None outside one
_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("one_pass_eval_scope", default=None)


@contextlib.contextmanager
def evaluation_scope() -> Iterator[None]:
    """Within the block (one evaluation pass over a split, the model's or the stacked tensors alive throughout),
    work that does not depend on the batch is done once: ``batch_invariant`` keeps its result until the block ends."""
    token = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(token)


def tensor_key(*tensors: Tensor) -> tuple:
    """A key for tensors that stay alive within an evaluation scope: their storage, version and shape."""
    return tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in tensors)


def batch_invariant(key: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()``, kept for the open evaluation scope under ``key`` (a client's text features over every class,
    the same for each test batch); computed afresh outside a scope or where a gradient is wanted (training)."""
    cache = _SCOPE.get()
    if cache is None or torch.is_grad_enabled():
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


@dataclass(frozen=True)
class Owners:
    """Which client each segment of a concatenated batch belongs to: what a one-pass forward reads its stacked
    per-client tensors (client axis first) through."""

    rows: tuple[int, ...]    # each segment's client row in the stacked tensors, in batch order
    sizes: tuple[int, ...]   # each segment's number of samples
    #: the stacked per-client tensors as the clients' round started (an anchor: FedProx's proximal term)
    start: dict[str, Tensor] = field(default_factory=dict, compare=False)

    def split(self, x: Tensor) -> tuple[Tensor, ...]:
        """``x`` (B, ...) cut into the segments, in batch order."""
        return x.split(list(self.sizes))

    def of(self, stacked: Tensor) -> list[Tensor]:
        """Each segment's client row of a stacked (C, ...) tensor."""
        rows = stacked.unbind(0)
        return [rows[r] for r in self.rows]

    def expand(self, stacked: Tensor) -> Tensor:
        """(B, ...): each sample's client row of a stacked (C, ...) tensor, broadcast over its segment as one by one
        broadcasts the client's own tensor over its batch (so the gradient sums over the segment alike)."""
        return torch.cat([row.unsqueeze(0).expand(n, *row.shape) for row, n in zip(self.of(stacked), self.sizes)])

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """Each segment through its client's linear layer (stacked weight (C, K, D) and bias (C, K))."""
        biases = self.of(bias) if bias is not None else [None] * len(self.rows)
        return torch.cat([F.linear(xs, w, b) for xs, w, b in zip(self.split(x), self.of(weight), biases)])

    def per_client(self, fn: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
        """(A,): ``fn`` of each segment of the batch tensors ``tensors`` (a client's loss on its own samples)."""
        return torch.stack([fn(*parts) for parts in zip(*(self.split(t) for t in tensors))])


#: each active client's loss (A,), in the order of ``Owners.rows``, of a concatenated batch; the model holds the
#: stacked per-client tensors
ClientLosses = Callable[[nn.Module, Any, Owners], Tensor]
#: after each optimiser step: (client position, tensor name, its new row, its row before the step) -> the row to
#: keep (FedPR's projection of the step), or None to keep the new row
AfterStep = Callable[[int, str, Tensor, Tensor], Tensor | None]


@dataclass
class Fitted:
    """One client after :func:`train_one_pass`: its per-client tensors, its mean loss per sample, its optimiser state
    in torch's ``state_dict`` format (only where asked to keep it) and how many steps it took."""

    state: dict[str, Tensor]
    loss: float
    optimizer: dict | None
    steps: int


class _Call(nn.Module):
    """The model and a loss as one module, so functional_call can run a loss that reads any part of the model."""

    def __init__(self, model: nn.Module, fn: ClientLosses) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, batch: Any, owners: Owners) -> Tensor:
        return self.fn(self.model, batch, owners)


def with_stacked(model: nn.Module, fn: ClientLosses) -> Callable[[dict[str, Tensor], Any, Owners], Tensor]:
    """``run(stacked, batch, owners)`` = ``fn(model, batch, owners)`` with the model's per-client tensors swapped
    for the stacked ones (by name). The model-and-loss module is built once, here: built inside a compiled step it
    broke Dynamo's graph at ``functional_call``."""
    call = _Call(model, fn)

    def run(stacked: dict[str, Tensor], batch: Any, owners: Owners) -> Tensor:
        return functional_call(call, {"model." + n: t for n, t in stacked.items()}, (batch, owners))

    return run


def concat_batches(batches: Sequence[Any]) -> Any:
    """One batch of several clients' batches (any pytree, every tensor leaf cut along its first axis)."""
    flat = [tree_flatten(b) for b in batches]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise ValueError("clients trained in one pass must give batches of one structure")
    leaves = []
    for i, leaf in enumerate(flat[0][0]):
        if isinstance(leaf, Tensor):
            leaves.append(torch.cat([f[0][i] for f in flat]))
        elif any(f[0][i] != leaf for f in flat[1:]):
            raise ValueError(f"batch leaf {i} differs between clients and is not a tensor: {leaf!r}")
        else:
            leaves.append(leaf)
    return tree_unflatten(leaves, spec)


def _first_tensor(batch: Any) -> Tensor:
    """A batch's first tensor field."""
    return next(leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, Tensor))


def _batch_len(batch: Any) -> int:
    """The number of samples in a batch: the length of its first tensor field."""
    return len(_first_tensor(batch))


class _Optimizer:
    """Torch's single-tensor SGD / Adam / AdamW replayed on row views of stacked tensors (module docstring)."""

    def __init__(self, spec: OptimizerSpec, state: dict[str, Tensor], names: Sequence[str],
                 kept: Sequence[dict | None]) -> None:
        self.spec, self.names = spec, list(names)
        k = len(kept)
        adam = spec.name != "sgd"
        self.buffers: dict[str, dict[str, Tensor]] = {}
        self.has = [[False] * len(self.names) for _ in range(k)]  # (client, tensor): a buffer exists (SGD)
        self.steps = [[0] * len(self.names) for _ in range(k)]     # (client, tensor): steps taken (Adam)
        kinds = ("exp_avg", "exp_avg_sq") if adam else (("momentum_buffer",) if spec.momentum else ())
        for kind in kinds:
            self.buffers[kind] = {n: torch.zeros_like(state[n]) for n in self.names}
        for c, st in enumerate(kept):
            for i, n in enumerate(self.names):
                own = (st or {}).get("state", {}).get(i)
                if not own:
                    continue
                for kind in kinds:
                    if own.get(kind) is not None:
                        self.buffers[kind][n][c].copy_(own[kind])
                        self.has[c][i] = True
                if adam:
                    self.steps[c][i] = int(float(own["step"]))

    @torch.no_grad()
    def step(self, state: dict[str, Tensor], grads: dict[str, Tensor], rows: Sequence[int]) -> None:
        """One step of every tensor with a gradient, on the clients ``rows`` (their gradient rows)."""
        sp = self.spec
        idx = [i for i, n in enumerate(self.names) if n in grads]
        ps = [state[self.names[i]][r] for r in rows for i in idx]
        gs = [grads[self.names[i]][r] for r in rows for i in idx]
        if not ps:
            return
        if sp.name == "sgd":
            ds = torch._foreach_add(gs, ps, alpha=sp.weight_decay) if sp.weight_decay else gs
            if sp.momentum:
                bufs = [self.buffers["momentum_buffer"][self.names[i]][r] for r in rows for i in idx]
                first = [(r, i) for r in rows for i in idx]
                new = [j for j, (r, i) in enumerate(first) if not self.has[r][i]]
                old = [j for j, (r, i) in enumerate(first) if self.has[r][i]]
                for j in new:  # torch: buf = clone(d_p) on the tensor's first step
                    bufs[j].copy_(ds[j])
                    self.has[first[j][0]][first[j][1]] = True
                if old:
                    torch._foreach_mul_([bufs[j] for j in old], sp.momentum)
                    torch._foreach_add_([bufs[j] for j in old], [ds[j] for j in old])
                ds = bufs
            torch._foreach_add_(ps, ds, alpha=-sp.lr)
            return
        beta1, beta2 = sp.betas
        if sp.weight_decay and sp.name == "adamw":
            torch._foreach_mul_(ps, 1 - sp.lr * sp.weight_decay)
        elif sp.weight_decay:
            gs = torch._foreach_add(gs, ps, alpha=sp.weight_decay)
        m1 = [self.buffers["exp_avg"][self.names[i]][r] for r in rows for i in idx]
        m2 = [self.buffers["exp_avg_sq"][self.names[i]][r] for r in rows for i in idx]
        torch._foreach_lerp_(m1, gs, 1 - beta1)
        torch._foreach_mul_(m2, beta2)
        torch._foreach_addcmul_(m2, gs, gs, value=1 - beta2)
        sizes, corr2 = [], []
        for r in rows:
            for i in idx:
                self.steps[r][i] += 1
                self.has[r][i] = True
                t = self.steps[r][i]
                sizes.append(-(sp.lr / (1 - beta1 ** t)))
                corr2.append((1 - beta2 ** t) ** 0.5)
        denom = torch._foreach_sqrt(m2)
        torch._foreach_div_(denom, corr2)
        torch._foreach_add_(denom, sp.eps)
        torch._foreach_addcdiv_(ps, m1, denom, sizes)

    def state_dict(self, c: int, like: dict[str, Tensor]) -> dict:
        """Client ``c``'s optimiser state as torch's ``state_dict`` (over the tensors in ``names`` order)."""
        params = [like[n].detach().clone() for n in self.names]
        opt = make_optimizer(params, self.spec)
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # torch's step dtype
        for i, (n, p) in enumerate(zip(self.names, params)):
            if not self.has[c][i]:
                continue
            if self.spec.name == "sgd":
                opt.state[p] = {"momentum_buffer": self.buffers["momentum_buffer"][n][c].clone()}
            else:
                opt.state[p] = {"step": torch.tensor(float(self.steps[c][i]), dtype=scalar),
                                "exp_avg": self.buffers["exp_avg"][n][c].clone(),
                                "exp_avg_sq": self.buffers["exp_avg_sq"][n][c].clone()}
        return opt.state_dict()


def train_one_pass(model: nn.Module, per_client: Sequence[str], trainable: Sequence[str],
                   starts: list[dict[str, Tensor]], streams: list[Iterator[Any]], losses: ClientLosses,
                   optimizer: dict | OptimizerSpec, *, kept: Sequence[dict | None] | None = None,
                   keep_optimizer: bool = False, after_step: AfterStep | None = None,
                   compile_mode: str | None = None) -> list[Fitted]:
    """Each client's update, all in one pass per step: ``per_client`` names the model's tensors that differ per
    client (every start holds them), ``trainable`` those the optimiser steps (a fresh one, or each client's
    ``kept`` torch ``state_dict``; with ``keep_optimizer`` each client's new one is returned), ``streams`` each
    client's batches in its order, ``losses`` each active client's loss of the concatenated batch. The model's
    own tensors are left as they were. ``compile_mode``: the loss under ``torch.compile(mode=...)`` (None: eager).
    """
    spec = optimizer_spec(optimizer)
    names, train_names = list(per_client), list(trainable)
    bad = [n for n in train_names if n not in names]
    if bad:
        raise ValueError(f"trainable tensors must be per-client: {bad}")
    _check_frozen_norms(model)
    k = len(starts)
    if k == 0:
        return []
    state = {n: torch.stack([s[n].detach() for s in starts]).clone() for n in names}
    start = {n: t.clone() for n, t in state.items()}
    opt = _Optimizer(spec, state, train_names, kept or [None] * k)
    forward = with_stacked(model, losses)
    run = torch.compile(forward, mode=compile_mode, dynamic=False) if compile_mode else forward
    sums = [0.0] * k
    totals: list[Tensor | None] = [None] * k  # each client's loss sum, on the device: no sync per step
    counts, steps = [0] * k, [0] * k
    live = list(range(k))
    while live:
        items = {c: next(streams[c], _END) for c in live}
        live = [c for c in live if items[c] is not _END]  # a finished stream is never pulled again
        if not live:
            break
        sizes = tuple(_batch_len(items[c]) for c in live)
        owners = Owners(tuple(live), sizes, start)
        batch = items[live[0]] if len(live) == 1 else concat_batches([items[c] for c in live])
        leaves = {n: state[n].detach().requires_grad_() for n in train_names}
        tensors = {n: (leaves[n] if n in leaves else state[n]) for n in names}
        with torch.enable_grad():
            with autocast_for(_first_tensor(batch)):  # the loss under the device's autocast, as run_epochs does
                per = run(tensors, batch, owners)
            if per.shape != (len(live),):
                raise ValueError(f"the loss must give one value per active client ({len(live)}), got "
                                 f"{tuple(per.shape)}")
            grads = torch.autograd.grad(per.sum(), list(leaves.values()), allow_unused=True)
        used = {n: g for n, g in zip(leaves, grads) if g is not None}  # unused: no gradient, no step (as torch)
        before = None
        if after_step is not None:
            before = {n: [state[n][c].clone() for c in live] for n in used}
        opt.step(state, used, live)
        if after_step is not None:
            with torch.no_grad():
                for n in used:
                    for j, c in enumerate(live):
                        kept_row = after_step(c, n, state[n][c], before[n][j])
                        if kept_row is not None:
                            state[n][c].copy_(kept_row)
        for j, (c, m) in enumerate(zip(live, sizes)):
            step = per[j].detach().double() * m
            totals[c] = step if totals[c] is None else totals[c] + step
            counts[c] += m
            steps[c] += 1
    for c in range(k):
        sums[c] = float(totals[c]) / counts[c] if counts[c] else float("nan")
    return [Fitted({n: state[n][c].clone() for n in names}, sums[c],
                   opt.state_dict(c, {n: state[n][c] for n in train_names}) if keep_optimizer else None, steps[c])
            for c in range(k)]


def _check_frozen_norms(model: nn.Module) -> None:
    """A BatchNorm that normalises by batch statistics would mix the clients of a concatenated batch: refuse it."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
            raise ValueError(f"one pass cannot train {name or 'the model'}: a BatchNorm in train mode normalises by "
                             "the statistics of the whole concatenated batch")
