"""REINFORCE: the vanilla policy-gradient loss −adv·logp.

"Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement Learning",
Ronald J. Williams, Machine Learning 8, 1992. https://doi.org/10.1007/BF00992696 (no arXiv).

**Change vs GRPO**: no importance ratio and no clip — the on-policy gradient that every clipped
surrogate reduces to when ``logp_old = logp``.

**Math** (per token; ``adv`` [b,G] broadcast to [b,G,T])::

    loss = -adv * logp            ∇loss = -adv · ∇logp

**Defaults**: none [PAPER].

**Notes**

1. Only the gradient is meaningful; the loss value depends on the log-probs themselves.
2. Used as the reference in the contract test "on-policy, the clipped objectives' gradient
   equals the REINFORCE gradient" (DESIGN §6).
3. Valid only on-policy (no correction for samples from an older policy).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.losses._common import term_mask, token_advantages
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("objective", "reinforce")
@dataclass
class Reinforce:
    """Vanilla policy gradient −A·logp per token, no ratio or clip (REINFORCE, Williams 1992)."""

    coef: float = 1.0
    agg: str | None = None

    needs = ()

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        mask = term_mask(mb)  # [b,G,T]
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        adv = token_advantages(mb, mask, "reinforce")  # [b,G,T]
        return -adv * logp  # [b,G,T]
