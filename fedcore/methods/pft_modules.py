"""FedPFT's building blocks (spec fedpft §1.3-§1.5): the feature transformation τ, the model a client trains
(extractor φ, τ, classifier h_κ, contrastive head h_ρ, prompts p_κ / p_ρ, MoCo key encoder) and MoCo's maths."""
from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

KEY_PARTS = ("net", "con_head")  # the MoCo key encoder: momentum copies of φ and h_ρ (spec §1.5)


def fp32(t: Tensor) -> Tensor:
    """A half-precision (autocast) tensor in fp32 for the losses; fp32 and fp64 stay as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class Views(NamedTuple):
    """One step's inputs: labels, the base view (L_CE) and MoCo's query and key views (L_Con); None where the
    phase has no such branch."""

    y: Tensor
    base: Tensor | None
    query: Tensor | None
    key: Tensor | None


class Tau(nn.Module):
    """One multi-head self-attention layer over [f, prompts]; its output token 0 is the transformed feature f'.

    No FFN (Table 10's τ counts 4m² + 4m exactly); heads, residual and LayerNorm are not stated (spec §8 A1):
    8 heads, plain attention output by default, ``residual`` (f' = f + attn) and ``norm`` (LayerNorm on f') as
    flags. Only token 0's query is computed: its output equals the full layer's token 0 (the others are discarded).
    """

    def __init__(self, dim: int, heads: int = 8, residual: bool = False, norm: bool = False) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, dropout=0.0)
        self.residual = residual
        self.norm = nn.LayerNorm(dim) if norm else None

    def tokens(self, f: Tensor, prompts: Tensor | None) -> Tensor:
        """[f, p_1 .. p_n] per sample, (B, 1 + n, m); [f] alone without prompts."""
        if prompts is None:
            return f[:, None, :]
        return torch.cat([f[:, None, :], prompts[None].expand(len(f), -1, -1).to(f.dtype)], dim=1)

    def forward(self, f: Tensor, prompts: Tensor | None) -> Tensor:
        """f' = τ([f, prompts])_0, (B, m)."""
        x = self.tokens(f, prompts)
        out = self.attn(x[:, :1], x, x, need_weights=False)[0][:, 0]
        if self.residual:
            out = f + out
        return out if self.norm is None else self.norm(out)

    @torch.no_grad()
    def attention(self, f: Tensor, prompts: Tensor | None) -> Tensor:
        """Attention weights of token 0 over [f, prompts], averaged over heads, (B, 1 + n) (Fig. 6)."""
        x = self.tokens(f, prompts)
        return self.attn(x[:, :1], x, x, need_weights=True, average_attn_weights=True)[1][:, 0]


class PFTModel(nn.Module):
    """What a FedPFT client trains: φ (``net``), τ (``tau``, absent in Setting VI), h_κ (``head``), h_ρ
    (``con_head``, absent without L_Con), prompts ``p_kappa`` / ``p_rho`` (absent when their count is 0 or there is
    no τ), and the MoCo key encoder ``key`` (frozen copies of φ and h_ρ: outside the client's state keys, kept in
    its MoCo state). Prediction: h_κ(τ([φ(x), p_κ])_0)."""

    def __init__(self, net: nn.Module, dim: int, num_classes: int, *, use_tau: bool, heads: int, residual: bool,
                 norm: bool, n_kappa: int, n_rho: int, contrastive: bool, con_dim: int, prompt_std: float) -> None:
        super().__init__()
        self.net = net
        net.requires_grad_(True)
        self.feature_dim = dim
        self.tau = Tau(dim, heads, residual, norm) if use_tau else None
        self.head = nn.Linear(dim, num_classes)
        self.con_head = nn.Linear(dim, con_dim) if contrastive else None
        self.p_kappa = nn.Parameter(torch.randn(n_kappa, dim) * prompt_std) if use_tau and n_kappa else None
        self.p_rho = nn.Parameter(torch.randn(n_rho, dim) * prompt_std) if use_tau and contrastive and n_rho else None
        self.key = None
        if contrastive:
            self.key = nn.ModuleDict({"net": copy.deepcopy(net), "con_head": copy.deepcopy(self.con_head)})
            self.key.requires_grad_(False)

    def transform(self, f: Tensor, prompts: Tensor | None, tau_grad: bool = True) -> Tensor:
        """τ([f, prompts])_0 (f itself without τ); ``tau_grad`` False: τ's weights get no gradient from this use
        (the prompts still do, through it)."""
        if self.tau is None:
            return f
        # τ in fp32 also under CUDA autocast: it is tiny, and vmapped attention's backward fails in bf16 on CUDA
        # (fedcore/engine/together.py, Limits), which the clients trained together would run into
        with torch.autocast(f.device.type, enabled=False):
            f = f.to(self.tau.attn.in_proj_weight.dtype)
            if tau_grad:
                return self.tau(f, prompts)
            frozen = {n: p.detach() for n, p in self.tau.named_parameters()}
            return functional_call(self.tau, frozen, (f, prompts))

    def features(self, x: Tensor) -> Tensor:
        """The transformed feature the classifier reads, τ([φ(x), p_κ])_0."""
        return self.transform(self.net(x), self.p_kappa)

    def forward(self, x: Tensor) -> Tensor:
        """Personalised logits."""
        return self.head(self.features(x))

    def key_features(self, x: Tensor) -> Tensor:
        """MoCo's key, normalised: h̃_ρ(τ([φ̃(x), p_ρ])_0) with the same τ and p_ρ as the query (spec §1.5)."""
        return F.normalize(fp32(self.key["con_head"](self.transform(self.key["net"](x), self.p_rho))), dim=1)


@torch.no_grad()
def momentum_update(key: nn.Module, model: nn.Module, m: float, foreach: bool = True) -> None:
    """MoCo's key update θ̃ ← m θ̃ + (1 − m) θ over the parameters of φ and h_ρ (buffers are the key's own), in
    place; ``foreach`` False: tensor by tensor, the same arithmetic (vmap has no batching rule for foreach ops)."""
    for part in KEY_PARTS:
        k = [p for p in key[part].parameters()]
        q = [p.detach() for p in getattr(model, part).parameters()]
        if foreach:
            torch._foreach_mul_(k, m)
            torch._foreach_add_(k, q, alpha=1.0 - m)
        else:
            for a, b in zip(k, q, strict=True):
                a.mul_(m).add_(b, alpha=1.0 - m)


def moco_loss(q: Tensor, k: Tensor, queue: Tensor, temperature: float) -> Tensor:
    """InfoNCE with the positive key at index 0 and the queue's K keys (columns of (dim, K)) as negatives."""
    pos = (q * k).sum(dim=1, keepdim=True)
    neg = q @ queue
    logits = torch.cat([pos, neg], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long, device=q.device))


def enqueue(queue: Tensor, ptr: int, keys: Tensor) -> int:
    """FIFO, in place: write ``keys`` (B, dim) over the oldest columns of ``queue`` (dim, K), wrapping around;
    returns the next column to overwrite. A batch larger than K keeps its last K keys."""
    size, n = queue.shape[1], len(keys)
    kept = keys[-size:]   # as if written one after another: the last K survive, at the columns they would reach
    cols = (ptr + n - len(kept) + torch.arange(len(kept), device=queue.device)) % size
    queue[:, cols] = kept.T.to(queue.dtype)
    return (ptr + n) % size


def enqueued(queue: Tensor, ptr: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`enqueue` as a function (a new queue; ``ptr`` a tensor): what clients trained together run under vmap."""
    size, n = queue.shape[1], len(keys)
    kept = keys[-size:]
    cols = (ptr + (n - len(kept)) + torch.arange(len(kept), device=queue.device)) % size
    return queue.index_copy(1, cols, kept.T.to(queue.dtype)), (ptr + n) % size
