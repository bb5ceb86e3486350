"""Sign advantage A = 2r − 1 against gradient starvation in binary-reward GRPO.

"Gradient Starvation in Binary-Reward GRPO: Why Group-Mean Centering Fails and Why the Simplest
Fix Works", Wenhua Nie et al., 2026. https://arxiv.org/abs/2605.07689 (spec: specs/48).

**Change vs GRPO**

- No group mean and no std: a fixed reference 1/2 replaces the group baseline, so all-correct
  (A = +1) and all-wrong (A = −1) groups still produce gradient.
- Per prompt, E[Σ_i (2r_i − 1) ∇log π(y_i)] = 2G·∇p, parallel to ∇pass@G = G(1−p)^{G−1}∇p.

**Math**::

    adv = 2 * r - 1
    degeneracy_rate = mean over groups of [all valid r equal]
    iid_degeneracy(p_bar, G) = p_bar**G + (1 - p_bar)**G  (a lower bound on E_x[p_x^G + (1-p_x)^G])

**Defaults**: none [ABSTRACT]. The paper pairs it with a Dr.GRPO-style constant normaliser and the
PPO clip [INFERRED, specs/48]: use ``aggregation = "constant"`` in a recipe.

**Notes**

1. For non-binary r in [0, 1] the same affine map 2r − 1 is used [INFERRED, specs/48].
2. Invalid rows (``group_valid`` False or a NaN reward) get exactly 0; |2r − 1| beyond float32's
   range (r > 1.7e38) saturates at ±3.4e38.
3. ``degeneracy_rate`` counts only groups with at least one valid (finite) reward; a group with a
   single valid row is degenerate (all its rewards are equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import constant_group, to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def degeneracy_rate(rewards: Tensor, valid: Tensor | None = None) -> float:
    """Fraction of groups (with ≥1 valid reward) whose valid rewards are all equal."""
    r = rewards.float()  # [B,G]
    ok = torch.isfinite(r) if valid is None else valid.bool() & torch.isfinite(r)  # [B,G]
    present = ok.any(1)  # [B]
    degenerate = constant_group(r, ok)[:, 0] & present  # [B]
    return float(degenerate.sum()) / max(int(present.sum()), 1)


def iid_degeneracy(p_bar: float, G: int) -> float:
    """Degeneracy of a group of G iid Bernoulli(p_bar) rewards: p^G + (1 − p)^G."""
    return p_bar**G + (1.0 - p_bar) ** G


@register("advantage", "sign")
@dataclass
class SignAdvantage:
    """Fixed-reference sign advantage A = 2r − 1, no group centring (Sign, Nie et al. 2026)."""

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        adv = 2.0 * r - 1.0  # [B,G] float64: 2r overflows float32 for r > 1.7e38
        return to_float32(torch.where(valid, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G]
