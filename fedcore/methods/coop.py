"""CoOp as FedOTP's local-training baseline: one personal prompt per client, no communication."""
from __future__ import annotations

from fedcore.methods import register_method
from fedcore.methods.base import EveryClient
from fedcore.methods.clip_prompt import ClipPromptMethod, PersonalClipEvaluator


@register_method
class CoOp(ClipPromptMethod):
    """CoOp (Zhou et al., IJCV 2022) trained locally (spec fedotp §4.2): each client learns its own 16-token unified
    context (N(0, 0.02^2), the same draw on every client) with CE on CLIP's CLS cosine x logit scale, on its own
    data only; nothing is sent. Every client trains every round (no server, participation does not apply), so T
    rounds of R local epochs are T x R epochs ([R] spec §8.15: the code's 10 or 30 epochs are config accidents;
    this is a federated client's local compute at full participation only: at Table A5's 10 % a FedOTP client
    trains about a tenth of it); a fresh optimiser per round, as every method, so momentum restarts every R epochs
    where the code's ``local`` model runs its epochs in one optimiser, and no warm-up (the code's PromptFL/local.yaml
    warms its first epoch at lr 1e-5); each client is scored with its prompt on its own test
    split in every evaluated round (the last for the tables, every round for Fig. A3's curve). Image tokens cached
    from the deterministic transform (clip_prompt.py)."""

    name = "coop"
    shared_prompts = ()
    strategy_role = EveryClient
    evaluator_role = PersonalClipEvaluator
