"""RLOO advantage: leave-one-out mean baseline.

"Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in
LLMs", Arash Ahmadian, Chris Cremer, Matthias Gallé, Marzieh Fadaee, Julia Kreutzer, Olivier
Pietquin, Ahmet Üstün, Sara Hooker, 2024. https://arxiv.org/abs/2402.14740
(the estimator is Kool, van Hoof, Welling 2019, "Buy 4 REINFORCE samples, get a baseline for free!")

**Change vs GRPO**

- The baseline of row i is the mean reward of the *other* valid rows of its group, so the
  baseline is independent of the row's own sample (unbiased policy gradient).
- No std division.

**Math** (``n`` = number of valid rows of the group)::

    adv_i = r_i - (Σ_{j≠i} r_j) / (n - 1) = n / (n - 1) · (r_i - mean_g(r))

**Defaults**: none (no hyper-parameters) [PAPER].

**Notes**

1. The second form is used (one masked mean per group); it equals the first exactly in real
   arithmetic and to float32 rounding in practice.
2. A group with fewer than 2 valid rows has no leave-one-out baseline: its rows get 0.
3. Invalid rows and constant groups get exactly 0.
4. Computed in float64; a value beyond float32's range saturates at ±3.4e38.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import group_center, to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("advantage", "rloo")
@dataclass
class RLOOAdvantage:
    """Leave-one-out baseline advantage r_i − mean_{j≠i} r_j (RLOO, Ahmadian et al. 2024)."""

    group_relative = True  # needs G >= 2: with one row per group every advantage is 0

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        n = valid.sum(1, keepdim=True).to(r.dtype)  # [B,1]
        factor = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))  # [B,1]
        adv = factor * group_center(r, valid)  # [B,G] float64
        return to_float32(torch.where(valid, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G]
