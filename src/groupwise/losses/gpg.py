"""GPG loss: the plain policy gradient −A·logp, averaged over every token of the batch.

"GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning", Xiangxiang Chu,
Hailang Huang, Xiao Zhang, Fei Wei, Yong Wang, 2025. https://arxiv.org/abs/2504.02546 — reference
implementation: verl ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_gpg`` (adapted there from
AMAP-ML/GPG ``grpo_trainer.py``).

**Change vs GRPO**: GPG "directly optimises the original RL objective": no importance ratio, no
clip, no reference model or KL term. Its other half — the corrected group advantage (the α
rescaling for groups that carry no signal) — is the advantage estimator's job (stage ``advantage``),
not this term's; combine the two in a recipe.

**Math** (per token; ``adv`` [b,G] broadcast to [b,G,T])::

    loss = -adv * logp                                   ∇loss = -adv · ∇logp
    L    = Σ_{rows,t} mask·loss / Σ_{rows,t} mask         (agg = "token_mean")

**Defaults**

- ``agg = "token_mean"`` [CODE] verl's default ``loss_agg_mode: token-mean``, with which
  ``compute_policy_loss_gpg`` aggregates; ``agg = None`` uses the objective's default instead.
- ``coef = 1.0`` [CODE] verl adds the policy loss unscaled.

**Notes**

1. Per token this is ``reinforce``; the two differ only in the default aggregation. Only the gradient
   is meaningful: the loss value depends on the log-probs themselves.
2. ``logp_old`` is not read, so with several epochs or mini-batches the samples are reused without any
   off-policy correction, exactly as in verl.
3. verl multiplies by ``rollout_is_weights`` when present; here any token weight (stage ``weight``)
   multiplies the term the same way (``token_weights = "token"``, the default).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.losses._common import term_mask, token_advantages
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("objective", "gpg")
@dataclass
class GPGLoss:
    """Plain policy gradient −A·logp with a token-mean over the batch (GPG, Chu et al. 2025)."""

    coef: float = 1.0
    agg: str | None = "token_mean"

    needs = ()

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        mask = term_mask(mb)  # [b,G,T]
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        adv = token_advantages(mb, mask, "gpg")  # [b,G,T]
        return -adv * logp  # [b,G,T]
