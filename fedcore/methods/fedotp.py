"""FedOTP (Li, Huang, Wang, Shi; CVPR 2024): a global and a local CoOp prompt per client over a frozen CLIP, matched
to an image's patches by unbalanced optimal transport; only the global prompt is averaged."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.constraints import Choice, Int, Number
from fedcore.engine.onepass import Owners
from fedcore.methods import register_method
from fedcore.methods.clip_prompt import ClipPromptMethod, ContextPrompts, PersonalClipEvaluator, fp32
from fedcore.methods.ot import STOPS, sinkhorn, unbalanced_ot

OT_KINDS = ("unbalanced", "classical", "similarity")
GLOBAL, LOCAL = "ctx_global", "ctx_local"  # the code's ctx[0] (averaged) and ctx[1] (never leaves the client)


def solve_plans(cost: Tensor, params: dict[str, Any]) -> Tensor:
    """Transport plans (..., M, N) of ``cost`` by the method's OT (``ot``: unbalanced or classical)."""
    p = params
    if p["ot"] == "unbalanced":
        return unbalanced_ot(cost, float(p["ot_gamma"]), float(p["ot_lambda"]), float(p["ot_eps"]),
                             int(p["ot_max_iter"]), p["ot_stop"])
    if p["ot"] == "classical":
        return sinkhorn(cost, float(p["ot_lambda"]), float(p["ot_eps"]), int(p["ot_max_iter"]), p["ot_stop"])
    raise ValueError(f"ot={p['ot']!r} computes no transport plan")


def ot_logits(patches: Tensor, text: Tensor, scale: float, params: dict[str, Any]) -> Tensor:
    """(B, K) logits = scale * sum_{m,n} T * sim (spec §1.8): patches (B, M, D) normalised, text (N, K, D)
    normalised, sim (B, K, M, N) their cosines, T the plan of the detached cost 1 - sim (a constant of the loss)."""
    with fp32(patches):
        sim = similarities(patches, text)
        plan = solve_plans(1.0 - sim.detach(), params)
        return scale * (plan * sim).sum((-2, -1))


def similarities(patches: Tensor, text: Tensor) -> Tensor:
    """(B, K, M, N) cosines of normalised patches (B, M, D) and prompts' text features (N, K, D), in fp32."""
    return torch.einsum("bmd,nkd->bkmn", patches.float(), text.float())


class OTPrompts(ContextPrompts):
    """The global and local contexts; scores by OT over the patch tokens, or (``similarity``) by the mean of the
    two prompts' CLS cosines."""

    def __init__(self, *args: Any, params: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params = params

    def forward(self, tokens: Tensor, owners: Owners | None = None) -> Tensor:
        """Logits (B, K) from the cached image tokens (B, 1+M, D); ``owners``: one pass, each segment with its own
        client's prompts, and, where each problem stops on its own (``ot_stop: problem``), one OT solve for all."""
        if owners is None or self.params["ot"] == "similarity" or self.params["ot_stop"] != "problem":
            return super().forward(tokens, owners)
        with fp32(tokens):
            sims = [similarities(F.normalize(t[:, 1:].float(), dim=-1), text)
                    for t, text in zip(owners.split(tokens), self.client_text_features(owners))]
            plans = solve_plans(1.0 - torch.cat(sims).detach(), self.params).split(list(owners.sizes))
            return torch.cat([self.logit_scale * (plan * sim).sum((-2, -1)) for plan, sim in zip(plans, sims)])

    def forward_text(self, tokens: Tensor, text: Tensor) -> Tensor:
        """Logits (B, K) from the cached image tokens (B, 1+M, D) against the prompts' text features (P, K, D)."""
        if self.params["ot"] == "similarity":
            return super().forward_text(tokens, text)
        patches = F.normalize(tokens[:, 1:].float(), dim=-1)
        return ot_logits(patches, text, self.logit_scale, self.params)


@register_method
class FedOTP(ClipPromptMethod):
    """FedOTP (spec fedotp §1.2-1.12, Algorithm 2): per client [P_g, P_l,i], two 16-token unified contexts (CSC=False,
    class token at the end) over a frozen CLIP; logits = logit_scale * sum(T * sim) with sim (M patches x 2 prompts)
    the cosines of the image's patch tokens with each prompt's text feature of the class and T the plan of the
    detached cost 1 - sim (``ot``): ``unbalanced`` (Algorithm 1: rows <= 1/M, columns gamma/N, gamma ``ot_gamma``
    0.8, lambda ``ot_lambda`` 0.1, stop when mean |dv| < ``ot_eps`` 1e-3, at most ``ot_max_iter`` 100 iterations),
    ``classical`` (Table A5's balanced variant: the code's Sinkhorn, rows 1/M, columns 1/N) or ``similarity``
    (Table A5's "Similarity Averaging": no OT, see below). Both prompts train together (one optimiser, CE over all
    classes); only P_g is uploaded and averaged, weighted by training-set size over the round's clients (Alg. 2
    line 16); P_l,i never leaves the client. Each client is evaluated with [P_g, its P_l,i] on its own test split.

    Choices where the supplement is silent ([C] official code, [R] spec recommendation; DEVIATIONS.md, FedOTP):
    * [C] Both prompts start from one N(0, 0.02^2) draw, the same on every client; tau = 1/CLIP's logit scale.
    * [C] ``round0_all`` (default true): every client trains in round 1, the code's round 0, whatever the
      participation; later rounds sample the experiment's fraction.
    * [C] A local epoch is a full pass over the client's data; a fresh optimiser per client per round ([R]; the code
      reuses one SGD object, so momentum leaks between clients), the experiment's (SGD 1e-3, momentum 0.9, wd 5e-4).
    * [R] The OT runs in fp32 (the code's fp16 gives NaN at lambda 0.01); its stopping test is per (image, class)
      problem (``ot_stop: problem``), where the code takes one mean over the batch (``ot_stop: batch``): a plan
      then does not depend on the other images of its batch. An underflowing exp(-C/lambda) is solved again in the
      log domain, the same iterates (fedcore/methods/ot.py), instead of the code's NaN crash.
    * [R] ``similarity``: undefined in the supplement and the code; logits = scale * mean over the two prompts of
      cos(CLS token, prompt's text feature) (spec §1.12), a flagged reading, not the paper's definition.
    * [R] Image tokens from the deterministic test transform, cached once (clip_prompt.py), where the code
      re-encodes random-resized crops every step.
    """

    name = "fedotp"
    defaults = {"n_ctx": 16, "round0_all": True, "ot": "unbalanced", "ot_gamma": 0.8, "ot_lambda": 0.1,
                "ot_eps": 1e-3, "ot_max_iter": 100, "ot_stop": "problem"}
    param_rules = {**ClipPromptMethod.param_rules, "ot": Choice(OT_KINDS), "ot_gamma": Number(0.0, 1.0, lo_open=True),
                   "ot_lambda": Number(0.0, lo_open=True), "ot_eps": Number(0.0, lo_open=True), "ot_max_iter": Int(1),
                   "ot_stop": Choice(STOPS)}
    prompt_names = (GLOBAL, LOCAL)
    shared_prompts = (GLOBAL,)
    evaluator_role = PersonalClipEvaluator

    def build(self, backbone: nn.Module) -> nn.Module:
        """The global and local contexts around the frozen CLIP."""
        self.check_backbone(backbone)
        return OTPrompts(backbone, self.class_names, int(self.params["n_ctx"]), self.prompt_names, params=self.params)


@torch.no_grad()
def transport_plans(method: FedOTP, model: OTPrompts, image_tokens: Tensor, labels: Tensor) -> Tensor:
    """(B, M, 2) plans of each image's patches to [global, local] prompt of its true class, with the prompts loaded
    in ``model`` (Fig. A4); float32."""
    if method.params["ot"] == "similarity":
        raise ValueError("fedotp with ot=similarity transports nothing: no plan to show")
    patches = F.normalize(image_tokens[:, 1:].float(), dim=-1)
    text = model.text_features()[:, labels.to(patches.device)]                   # (N, B, D)
    sim = torch.einsum("bmd,nbd->bmn", patches, text.float())
    return solve_plans(1.0 - sim, method.params)
