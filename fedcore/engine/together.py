"""Train several clients' copies of one module together: one vectorised forward+backward per step.

Every per-client tensor (the keys ``names``: trainable parameters, per-client frozen parameters, buffers
such as BatchNorm running stats) is stacked on a leading client axis. At step t each client whose stream
still yields a batch is active; the active clients are grouped by the shapes of their batches (clients
whose batch pytrees have identical structure, shapes and dtypes form a group, so a short last batch or a
client with fewer batches simply lands in another group or drops out), and each group runs one
``vmap(loss)`` over ``functional_call`` of the shared module, then one ``autograd.grad`` of the summed
losses: client c's loss depends only on its own rows, so row c of the gradient is its own gradient. (Not
``vmap(grad_and_value(loss))``: torch.func's grad imports torch._dynamo, ~1.5 s of CPU a job, for the same
numbers; tests/test_together.py compares the two.) Parameters of the module
that are not in ``names`` are shared and frozen: they are passed once, unbatched (in_dims None). The
optimiser (SGD with momentum/weight decay, Adam, AdamW) is re-implemented functionally with the same
operations as torch.optim's single-tensor code (its CPU default) and applied only to the group's rows.

Equality: each client sees exactly the batches, the loss and the optimiser arithmetic of
:func:`one_by_one` (a fresh torch.optim optimiser per client), so the results agree up to float
reassociation inside the vectorised kernels (the tests check 1e-5). Adam amplifies such rounding
differences in gradient entries near zero (e.g. a conv bias right before BN, whose true gradient is 0),
as it does between two thread counts of torch's own loop, so long Adam runs agree less tightly. Because
streams are consumed lazily and a finished client never comes back, a client active at step t has taken
exactly t steps before, so Adam's step count and SGD's "first step" are the same scalar for the whole
group.

BatchNorm: in train mode, torch's batch-norm batching rule normalises each client with its own batch
statistics and, when the running stats are batched too, updates every client's own row in place. The
vmapped function works on clones of the buffers and returns them (read back from the module inside the
functional call, so in-place updates and reassignments are both caught); the caller writes them into the
group's rows. Under autocast each BatchNorm normalises in its own (fp32) dtype: on CUDA the vmapped batch norm
raises on a bf16 input with fp32 running statistics (:func:`batchnorm_in_own_dtype`).

Phases (:func:`train_phases_together`, reference :func:`phases_one_by_one`): a client update made of several
kinds of step (FedPFT's feature and task phases) is one optimiser (or a fresh one at each change of phase:
``fresh_per_phase``) over streams of (phase, batch) steps; each :class:`Phase` names the tensors it trains and
its loss. Clients are grouped per step also by phase and by how
many steps each trained tensor has taken, so the optimiser's first step (SGD) and step count (Adam) are one
number per group; per-tensor learning rates play torch's parameter groups. Method-owned per-client state
outside the module (a MoCo queue and its pointer: ``carries``) is stacked like the module's tensors, handed to
the loss and replaced by the values it returns; module tensors the loss changes in place besides BatchNorm
buffers (``mutable``: a momentum encoder's EMA) are cloned before the call and read back after it, as the
buffers are. A phase's ``prepare`` runs batched work without gradient on the group's stacked batch before the
vmapped loss (views whose random draws each client made from its own generator).

Limits: the loss must draw no random numbers (vmap runs with ``randomness="error"``); every buffer the
forward mutates must be in ``names`` (a shared buffer cannot take per-client updates: torch.func raises
on the in-place update of a captured tensor; :func:`can_vmap` checks BatchNorm beforehand); the loss must
be a scalar mean over the batch; attention runs the math kernel, and on CUDA (torch 2.11, H100) its backward
under vmap fails with bf16 autocast ("expected input and grad types to match") while the fused kernels' fails
in any precision ("LSE is not correctly aligned"); in fp32 it ran, but 3.5x slower than one client at a time for
ViT-B/16 prompts (510 vs 1,806 images/s, 5 clients, batch 40), so on CUDA the engine never vmaps attention
models (:func:`has_attention`; prompt models take the one pass, fedcore/engine/onepass.py); ``loss_fn`` sees the
real module (its tensors swapped by ``functional_call``), so it must not hold on to the module's tensors across
calls.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fedcore.engine.optim import OptimizerSpec, make_optimizer, optimizer_spec

Result = list[tuple[dict[str, Tensor], float]]
_END = object()
_TENSOR = object()  # marks a batch leaf that is a (stacked) tensor


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` holds attention layers (timm/fedcore ViT ``Attention``, ``nn.MultiheadAttention``)."""
    return any(isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention") for m in model.modules())


def _norm_input_dtype(module: nn.Module, args: tuple) -> tuple | None:
    """A BatchNorm's input cast to the dtype of its weights and running statistics (see :func:`batchnorm_in_own_dtype`)."""
    own = next((t.dtype for t in (module.weight, module.running_mean) if isinstance(t, Tensor)), None)
    x = args[0]
    if own is None or not isinstance(x, Tensor) or x.dtype == own:
        return None
    return (x.to(own), *args[1:])


@contextlib.contextmanager
def batchnorm_in_own_dtype(model: nn.Module) -> Iterator[None]:
    """Within the block every BatchNorm of ``model`` normalises its input in the dtype of its own weights and running
    statistics (fp32), not autocast's bf16: vmapped batch norm on CUDA refuses a bf16 input with fp32 running
    statistics ("Expected running_mean to have type BFloat16 but got Float"), which CPU autocast does not show."""
    handles = [m.register_forward_pre_hook(_norm_input_dtype) for m in model.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def default_batch_len(batch: Any) -> int:
    """The number of samples in a batch: the length of its first tensor field."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, Tensor):
            return len(leaf)
    raise ValueError("a batch must hold at least one tensor")


def _check(model: nn.Module, names: list[str], trainable: list[str]) -> tuple[set[str], set[str]]:
    """The module's parameter and buffer names, after checking ``names`` and ``trainable`` against them."""
    params = {n for n, _ in model.named_parameters()}
    buffers = {n for n, _ in model.named_buffers()}
    unknown = [n for n in names if n not in params and n not in buffers]
    if unknown:
        raise ValueError(f"names not in the module's parameters or buffers: {unknown}")
    bad = [n for n in trainable if n not in names or n not in params]
    if bad:
        raise ValueError(f"trainable must be parameters listed in names: {bad}")
    if not trainable:
        raise ValueError("trainable is empty")
    return params, buffers


def can_vmap(model: nn.Module, names: list[str]) -> bool:
    """Whether every buffer that a train-mode forward would update (BatchNorm running stats) is per-client."""
    keys = set(names)
    for prefix, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training and mod.track_running_stats:
            for b, _ in mod.named_buffers(recurse=False):
                if (f"{prefix}.{b}" if prefix else b) not in keys:
                    return False
    return True


@dataclass(frozen=True)
class Phase:
    """One kind of step of a client update (:func:`train_phases_together`): the tensors it trains and its loss.

    ``loss(module, batch, carry) -> (loss, new_carry, logs)``: the scalar mean loss of the batch; new values for
    some of the client's ``carry`` tensors (method-owned state outside the module, e.g. a MoCo queue: computed
    functionally, written back after the step); named scalar means over the batch to log. It may update the
    tensors named ``mutable`` in place (read back after the call, as BatchNorm buffers are). ``prepare``, optional:
    batched work without gradient on the group's stacked batch (every tensor leaf with the client axis first)
    before the loss, e.g. augmentations whose random draws each client's stream made from its own generator.
    """

    trainable: tuple[str, ...]
    loss: Callable[[nn.Module, Any, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]]
    prepare: Callable[[Any], Any] | None = None


@dataclass
class Trained:
    """One client after :func:`train_phases_together`: its tensors (every key of ``names``), its carry, and each
    logged value's mean per sample over the steps that logged it (``loss`` always)."""

    state: dict[str, Tensor]
    carry: dict[str, Tensor]
    logs: dict[str, float]


def _tensor_of(module: nn.Module, name: str) -> Tensor:
    """The parameter or buffer ``name`` as the module holds it now (also a tensor swapped in by functional_call)."""
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attr)


class _Bound(nn.Module):
    """The model and the loss as one module, so functional_call can run a loss that uses any part of it."""

    def __init__(self, model: nn.Module, changing: list[str]):
        super().__init__()
        self.model = model
        self.loss_fn: Callable = lambda module, batch, carry: None  # the group's phase loss, set before each call
        self.changing = changing

    def forward(self, batch: Any, carry: dict[str, Tensor]) -> tuple[Tensor, dict, dict, dict[str, Tensor]]:
        loss, new_carry, logs = self.loss_fn(self.model, batch, carry)
        # read inside the call: the swapped-in tensors after the forward updated them (in place or not)
        return loss, new_carry, logs, {n: _tensor_of(self.model, n).detach() for n in self.changing}


def _put(store: dict[str, Tensor], name: str, rows: Tensor | None, value: Tensor) -> None:
    """Write ``value`` into the group's rows of ``store[name]`` (all rows: just rebind)."""
    if rows is None:
        store[name] = value
    else:
        store[name].index_copy_(0, rows, value)


def _take(t: Tensor, rows: Tensor | None) -> Tensor:
    """The group's rows of a stacked tensor."""
    return t if rows is None else t.index_select(0, rows)


@torch.no_grad()
def _update(hp: OptimizerSpec, state: dict[str, Tensor], moments: dict[str, dict[str, Tensor]],
            grads: dict[str, Tensor], rows: Tensor | None, steps: dict[str, int], lrs: dict[str, float]) -> None:
    """One optimiser step on the group's rows, with the operations of torch.optim's single-tensor code; ``steps``:
    how many steps each tensor took before (the same for the group's rows), ``lrs``: per-tensor learning rates."""
    wd = hp.weight_decay
    for n, g in grads.items():
        lr = lrs.get(n, hp.lr)
        p = _take(state[n], rows)
        if hp.name == "sgd":
            d = g.add(p, alpha=wd) if wd else g
            if hp.momentum:
                bufs = moments.setdefault("momentum", {})
                if n not in bufs:
                    bufs[n] = torch.zeros_like(state[n])
                # the tensor's first step: torch sets buf = d_p
                buf = d.clone() if steps[n] == 0 else _take(bufs[n], rows).mul(hp.momentum).add(d)
                _put(bufs, n, rows, buf)
                d = buf
            p = p.add(d, alpha=-lr)
        else:
            beta1, beta2 = hp.betas
            if wd and hp.name == "adamw":
                p = p.mul(1 - lr * wd)
            elif wd:
                g = g.add(p, alpha=wd)
            avg = moments.setdefault("exp_avg", {})
            sq = moments.setdefault("exp_avg_sq", {})
            if n not in avg:
                avg[n], sq[n] = torch.zeros_like(state[n]), torch.zeros_like(state[n])
            m1 = _take(avg[n], rows).lerp(g, 1 - beta1)
            m2 = _take(sq[n], rows).mul(beta2).addcmul(g, g, value=1 - beta2)
            _put(avg, n, rows, m1)
            _put(sq, n, rows, m2)
            t = float(steps[n] + 1)
            step_size = lr / (1 - beta1 ** t)
            denom = (m2.sqrt() / (1 - beta2 ** t) ** 0.5).add(hp.eps)
            p = p.addcdiv(m1, denom, value=-step_size)
        _put(state, n, rows, p)


def _leaf_key(leaf: Any) -> Any:
    """What must agree for two clients' batch leaves to be stacked."""
    if isinstance(leaf, Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
    try:
        hash(leaf)
        return ("value", type(leaf), leaf)
    except TypeError:
        return ("object", id(leaf))


def _check_phases(model: nn.Module, names: list[str], phases: dict[Any, Phase], mutable: Sequence[str],
                  lrs: dict[str, float]) -> tuple[list[str], set[str]]:
    """Every tensor trained by some phase, and the module's buffer names, after checking the arguments."""
    if not phases:
        raise ValueError("phases is empty")
    trained: list[str] = []
    for ph in phases.values():
        trained += [n for n in ph.trainable if n not in trained]
    _, buffers = _check(model, names, trained)
    for key, ph in phases.items():
        if not ph.trainable:
            raise ValueError(f"phase {key!r} trains nothing")
    bad = [n for n in mutable if n not in names or n in trained]
    if bad:
        raise ValueError(f"mutable must be per-client tensors (in names) that no phase trains: {bad}")
    bad = [n for n in lrs if n not in trained]
    if bad:
        raise ValueError(f"lrs names tensors that no phase trains: {bad}")
    return trained, buffers


def train_phases_together(model: nn.Module, names: list[str], phases: dict[Any, Phase],
                          starts: list[dict[str, Tensor]], streams: list[Iterator[tuple[Any, Any]]],
                          optimizer: dict, *, carries: list[dict[str, Tensor]] | None = None,
                          mutable: Sequence[str] = (), lrs: dict[str, float] | None = None,
                          batch_len: Callable[[Any], int] = default_batch_len,
                          fresh_per_phase: bool = False) -> list[Trained]:
    """Each client trained together, one optimiser over every phase: streams yield (phase key, batch) steps.

    Clients are grouped per step by phase, batch structure and how many steps each trained tensor has taken
    (one Adam step count / SGD first step per group); a tensor that a phase does not train gets no gradient
    and no optimiser step there (torch.optim skips it), as :func:`phases_one_by_one` with ``requires_grad``
    off. ``lrs``: learning rates of single tensors (torch's parameter groups), default the optimiser's lr.
    ``fresh_per_phase``: a client whose phase changes starts a fresh optimiser (no momentum, Adam moments or step
    count carried over), as a new torch optimiser per phase would.
    """
    hp = optimizer_spec(optimizer)
    lrs = dict(lrs or {})
    trained, buffers = _check_phases(model, names, phases, mutable, lrs)
    k = len(starts)
    if k == 0:
        return []
    carries = carries if carries is not None else [{} for _ in range(k)]
    state = {n: torch.stack([s[n].detach() for s in starts]) for n in names}
    carry = {n: torch.stack([c[n].detach() for c in carries]) for n in carries[0]}
    # frozen, shared by every client: passed once, unbatched; detached so no outer graph is built
    shared = {"model." + n: p.detach() for n, p in model.named_parameters() if n not in state}
    changing = [n for n in names if n in buffers or n in set(mutable)]
    bound = _Bound(model, changing)
    changing_set = set(changing)

    def client_loss(train: dict[str, Tensor], other: dict[str, Tensor], frozen: dict[str, Tensor],
                    own: dict[str, Tensor], leaves: list[Tensor], spec: Any, loose: list[Any]) -> tuple:
        """One client's loss on its batch, new carry, logs, and its changed tensors after the forward."""
        it = iter(leaves)
        batch = tree_unflatten([next(it) if lf is _TENSOR else lf for lf in loose], spec)
        # clones: the forward updates buffers (and ``mutable``) in place; the inputs stay untouched
        tensors = {**frozen, **{"model." + n: t.clone() if n in changing_set else t for n, t in other.items()},
                   **{"model." + n: t for n, t in train.items()}}
        return functional_call(bound, tensors, (batch, own))

    device = state[names[0]].device
    sums: dict[str, Tensor] = {}  # per-client weighted sums, on the device: no sync per step
    seen: dict[str, list[int]] = {}
    steps = [dict.fromkeys(trained, 0) for _ in range(k)]
    moments: dict[str, dict[str, Tensor]] = {}
    rows_cache: dict[tuple[int, ...], Tensor | None] = {}
    last_phase: list[Any] = [_END] * k
    live = list(range(k))
    while live:
        items = {c: next(streams[c], _END) for c in live}
        live = [c for c in live if items[c] is not _END]  # a finished stream is never pulled again
        groups: dict[Any, list[int]] = {}
        flat: dict[int, tuple[list[Any], Any]] = {}
        for c in live:
            key, batch = items[c]
            if fresh_per_phase and last_phase[c] is not _END and key != last_phase[c]:
                steps[c] = dict.fromkeys(trained, 0)  # SGD's first step again, Adam's count from 1
                for bufs in moments.values():
                    for t in bufs.values():
                        t[c].zero_()
            last_phase[c] = key
            leaves, spec = tree_flatten(batch)
            flat[c] = (leaves, spec)
            counts = tuple(steps[c][n] for n in phases[key].trainable)
            groups.setdefault((key, counts, spec, tuple(_leaf_key(lf) for lf in leaves)), []).append(c)
        for (key, _, _, _), members in groups.items():
            phase = phases[key]
            group = tuple(members)
            if group not in rows_cache:
                # every client, in order: the stacked tensors are used whole, without gathers
                rows_cache[group] = None if group == tuple(range(k)) else torch.tensor(members, device=device)
            rows = rows_cache[group]
            leaves0, spec = flat[members[0]]
            stacked = tree_unflatten([torch.stack([flat[c][0][i] for c in members]) if isinstance(lf, Tensor) else lf
                                      for i, lf in enumerate(leaves0)], spec)
            if phase.prepare is not None:
                with torch.no_grad():
                    stacked = phase.prepare(stacked)
            leaves, spec = tree_flatten(stacked)
            loose = [_TENSOR if isinstance(lf, Tensor) else lf for lf in leaves]
            tensors = [lf for lf in leaves if isinstance(lf, Tensor)]
            train = {n: _take(state[n], rows).detach().requires_grad_() for n in phase.trainable}
            other = {n: _take(state[n], rows) for n in names if n not in train}
            own = {n: _take(t, rows) for n, t in carry.items()}
            bound.loss_fn = phase.loss
            fn = vmap(lambda tr, ot, fr, ow, lv: client_loss(tr, ot, fr, ow, lv, spec, loose),
                      in_dims=(0, 0, None, 0, 0), randomness="error")
            # the math attention kernel: the fused kernels' backward has no working batching rule (see Limits);
            # BatchNorm in fp32 under autocast (cudnn's vmapped batch norm wants one dtype)
            with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH), batchnorm_in_own_dtype(model):
                loss, new_carry, logs, changed = fn(train, other, shared, own, tensors)
                grads = torch.autograd.grad(loss.sum(), list(train.values()), allow_unused=True)
            for n, v in changed.items():
                _put(state, n, rows, v.detach())
            for n, v in new_carry.items():
                _put(carry, n, rows, v.detach())
            used = {n: g for n, g in zip(train, grads) if g is not None}  # unused: no gradient, no step
            _update(hp, state, moments, used, rows, {n: steps[members[0]][n] for n in used}, lrs)
            lens = [batch_len(items[c][1]) for c in members]
            for c, m in zip(members, lens):
                for n in used:
                    steps[c][n] += 1
            weights = torch.tensor(lens, dtype=torch.float64, device=device)
            for name, v in {"loss": loss, **logs}.items():
                if name not in sums:
                    sums[name], seen[name] = torch.zeros(k, dtype=torch.float64, device=device), [0] * k
                weighted = v.detach().double() * weights
                if rows is None:
                    sums[name] += weighted
                else:
                    sums[name].index_add_(0, rows, weighted)
                for c, m in zip(members, lens):
                    seen[name][c] += m
    totals = {name: t.tolist() for name, t in sums.items()}
    return [Trained({n: state[n][c].clone() for n in names}, {n: t[c].clone() for n, t in carry.items()},
                    {name: totals[name][c] / seen[name][c] for name in totals if seen[name][c]})
            for c in range(k)]


def train_together(model: nn.Module, names: list[str], trainable: list[str],
                   starts: list[dict[str, Tensor]], streams: list[Iterator[Any]],
                   loss_fn: Callable[[nn.Module, Any], Tensor], optimizer: dict,
                   batch_len: Callable[[Any], int] = default_batch_len) -> Result:
    """Each client's final state (every key of ``names``) and its mean loss per sample, trained together."""
    phase = Phase(tuple(trainable), lambda module, batch, carry: (loss_fn(module, batch), {}, {}))
    out = train_phases_together(model, names, {0: phase}, starts, [((0, b) for b in s) for s in streams],
                                optimizer, batch_len=batch_len)
    return [(t.state, t.logs.get("loss", math.nan)) for t in out]


def phases_one_by_one(model: nn.Module, names: list[str], phases: dict[Any, Phase],
                      starts: list[dict[str, Tensor]], streams: list[Iterator[tuple[Any, Any]]],
                      optimizer: dict, *, carries: list[dict[str, Tensor]] | None = None,
                      mutable: Sequence[str] = (), lrs: dict[str, float] | None = None,
                      batch_len: Callable[[Any], int] = default_batch_len,
                      fresh_per_phase: bool = False) -> list[Trained]:
    """The reference of :func:`train_phases_together`: each client in turn, loaded into ``model``, one fresh torch
    optimiser (a parameter group per learning rate) over every phase (``fresh_per_phase``: a new one whenever the
    phase changes), each phase's tensors alone requiring grad."""
    hp = optimizer_spec(optimizer)
    lrs = dict(lrs or {})
    trained, _ = _check_phases(model, names, phases, mutable, lrs)
    carries = carries if carries is not None else [{} for _ in starts]

    def tensors() -> dict[str, Tensor]:
        # re-read every time: a module may reassign a buffer during its forward
        return {**dict(model.named_buffers()), **dict(model.named_parameters())}

    saved = {n: tensors()[n].detach().clone() for n in names}
    flags = {n: (p.requires_grad, p.grad) for n, p in model.named_parameters()}
    out: list[Trained] = []
    try:
        for p in model.parameters():
            p.grad = None
        for start, stream, own in zip(starts, streams, carries):
            with torch.no_grad():
                current = tensors()
                for n in names:
                    current[n].copy_(start[n])
            params = dict(model.named_parameters())
            by_lr: dict[float, list[Tensor]] = {}
            for n in trained:
                by_lr.setdefault(lrs.get(n, hp.lr), []).append(params[n])
            groups = [{"params": ps, "lr": lr} for lr, ps in by_lr.items()]
            opt = make_optimizer(groups, hp)
            carry = {n: t.detach().clone() for n, t in own.items()}
            sums: dict[str, Tensor] = {}
            seen: dict[str, int] = {}
            last = _END
            for key, batch in stream:
                if fresh_per_phase and last is not _END and key != last:
                    opt = make_optimizer(groups, hp)
                last = key
                phase = phases[key]
                m = batch_len(batch)
                if phase.prepare is not None:  # on a stack of one client, as train_phases_together's groups
                    with torch.no_grad():
                        one = tree_map(lambda t: t[None] if isinstance(t, Tensor) else t, batch)
                        batch = tree_map(lambda t: t[0] if isinstance(t, Tensor) else t, phase.prepare(one))
                for n, p in params.items():
                    p.requires_grad_(n in phase.trainable)  # frozen parts get no .grad, as under vmap
                opt.zero_grad(set_to_none=True)
                loss, new_carry, logs = phase.loss(model, batch, carry)
                loss.backward()
                opt.step()
                carry.update({n: v.detach() for n, v in new_carry.items()})
                for name, v in {"loss": loss, **logs}.items():
                    step = v.detach().double() * m
                    sums[name] = step if name not in sums else sums[name] + step
                    seen[name] = seen.get(name, 0) + m
            current = tensors()
            out.append(Trained({n: current[n].detach().clone() for n in names}, carry,
                               {name: t.item() / seen[name] for name, t in sums.items()}))
    finally:
        with torch.no_grad():
            current = tensors()
            for n, t in saved.items():
                current[n].copy_(t)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n][0])
            p.grad = flags[n][1]
    return out


def one_by_one(model: nn.Module, names: list[str], trainable: list[str],
               starts: list[dict[str, Tensor]], streams: list[Iterator[Any]],
               loss_fn: Callable[[nn.Module, Any], Tensor], optimizer: dict,
               batch_len: Callable[[Any], int] = default_batch_len) -> Result:
    """The reference: each client in turn, loaded into ``model`` and trained with a fresh torch optimiser."""
    phase = Phase(tuple(trainable), lambda module, batch, carry: (loss_fn(module, batch), {}, {}))
    out = phases_one_by_one(model, names, {0: phase}, starts, [((0, b) for b in s) for s in streams], optimizer,
                            batch_len=batch_len)
    return [(t.state, t.logs.get("loss", math.nan)) for t in out]
