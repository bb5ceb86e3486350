"""μ-GRPO's objective: a relaxed clipped surrogate with a post-trigger veto on negative-advantage rows.

"μ-GRPO: high-staleness staged GRPO" (arXiv 2605.17570; specs/06). Read: the spec, assembled from
the project page (https://github.com/BenjaminT2048/mu-grpo-project-page, ``index.html``); no code.

**Change vs GRPO**: many optimiser updates per rollout (``train.epochs`` = μ, the staleness) made
safe by (a) a relaxed ratio clip ``[1 − eps_low, 1 + eps_high] = [0, 5]`` and (b) a veto: in a
negative-advantage row, once some token's ratio π_θ/π_behav has collapsed below ``delta`` (the
*trigger*), the tokens after it get no gradient. The behaviour policy is the rollout's sampler
(``logp_old``); the veto is recomputed in every micro-batch, because the ratio changes.

**Math** (per row i with A_i < 0; ``ratio`` [b,G,T])::

    trig_t = ratio_t < delta  and  t in the loss mask
    κ      = the first t with trig_t                      (none: nothing vetoed)
    keep_t = 0  for  t > κ                                scope "suffix"            (𝒮_κ)
             0  for  t > κ and not trig_t                 scope "nontrigger_suffix" (ℋ_κ)
             0  for  every t                               scope "sequence"          (𝒮_seq)
             0  for  trig_t                                scope "trigger"           (𝒯)
    loss_t = keep_t · −min(ratio_t A, clip(ratio_t, 1 − eps_low, 1 + eps_high) A)

**Defaults**

- ``eps_low = 1.0``, ``eps_high = 4.0`` (clip to [0, 5]) [PAPER-SUMMARY] the project page's relaxed
  clip (specs/06 is PARTIAL: the page, not the paper, was read).
- ``delta = 1e-4`` [INFERRED] the page's illustration shows trigger ratios "< 10⁻⁴"; no value given.
- ``scope = "suffix"`` [INFERRED] the page says μ-GRPO "masks the unsafe post-trigger updates" and
  shows 𝒮_κ, ℋ_κ and 𝒮_seq all stable; which one the method uses is not stated. All four are options.

**Notes**

1. With scope "suffix" the trigger token itself is kept: its ratio is already ~0, so its gradient
   ratio·A·∇logp is ~0 too (the page's argument).
2. Positive-advantage rows are never vetoed; a row without a trigger is plain PPO-clip.
3. The veto is a 0/1 mask built from the detached ratio: it selects tokens, it carries no gradient.
   Vetoed tokens stay in the aggregation's denominator (their loss is 0, as the spec's "zero L_tok").
4. ``eps_low = 1`` makes the lower bound 0, i.e. no lower clip (ratio ≥ 0); ``check_clip(...,
   no_lower_clip=True)`` allows it (``ppo_clip`` too: the claim's no-veto arm is ppo_clip at [0, 5]).
5. ``stats``: ``mu_grpo/vetoed`` (vetoed loss tokens per loss token), ``mu_grpo/triggered`` (tokens
   under ``delta`` in negative rows, per loss token) and the clip indicators of ``clip_stats``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import check_clip, clip_stats, clipped_surrogate, ratio_and_adv, term_mask
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

SCOPES = ("suffix", "nontrigger_suffix", "sequence", "trigger")


def triggers(ratio: Tensor, adv: Tensor, mask: Tensor, delta: float) -> Tensor:
    """[b,G,T] bool: loss tokens of negative-advantage rows whose ratio collapsed under ``delta``."""
    return (ratio.detach() < delta) & mask & (adv < 0)  # [b,G,T]


def veto_keep(ratio: Tensor, adv: Tensor, mask: Tensor, delta: float, scope: str) -> Tensor:
    """[b,G,T] bool keep mask: False where the post-trigger veto of a negative-advantage row applies."""
    trig = triggers(ratio, adv, mask, delta)  # [b,G,T]
    seen = trig.long().cumsum(-1)  # [b,G,T] triggers up to and including t
    after = (seen - trig.long()) > 0  # [b,G,T] strictly after the first trigger
    if scope == "suffix":
        vetoed = after
    elif scope == "nontrigger_suffix":
        vetoed = after & ~trig
    elif scope == "sequence":
        vetoed = trig.any(-1, keepdim=True).expand_as(trig)  # [b,G,T]
    else:  # "trigger"
        vetoed = trig
    return ~vetoed


@register("objective", "mu_grpo")
@dataclass
class MuGRPO:
    """Relaxed clipped surrogate with a post-trigger veto on negative-advantage rows (μ-GRPO, arXiv 2605.17570)."""

    eps_low: float = 1.0
    eps_high: float = 4.0
    delta: float = 1e-4
    scope: str = "suffix"
    coef: float = 1.0
    agg: str | None = None

    needs = ()

    def __post_init__(self) -> None:
        check_clip("mu_grpo", self.eps_low, self.eps_high, no_lower_clip=True)
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"mu_grpo: delta (the trigger ratio) must be in (0, 1), got {self.delta}")
        if self.scope not in SCOPES:
            raise ValueError(f"mu_grpo: scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")

    def _keep(self, mb: Rollout, ratio: Tensor, adv: Tensor) -> Tensor:
        return veto_keep(ratio, adv, term_mask(mb), self.delta, self.scope)  # [b,G,T]

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        ratio, adv = ratio_and_adv(mb, out, "mu_grpo")  # [b,G,T], [b,G,T]
        loss = clipped_surrogate(ratio, adv, self.eps_low, self.eps_high)  # [b,G,T]
        return torch.where(self._keep(mb, ratio, adv), loss, torch.zeros((), dtype=loss.dtype))  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv = ratio_and_adv(mb, out, "mu_grpo")  # [b,G,T], [b,G,T]
        mask = term_mask(mb)  # [b,G,T]
        return {
            **clip_stats(ratio, adv, self.eps_low, self.eps_high),
            "mu_grpo/vetoed": (~self._keep(mb, ratio, adv) & mask).float(),  # [b,G,T]
            "mu_grpo/triggered": triggers(ratio, adv, mask, self.delta).float(),
        }  # [b,G,T]
