"""OPO: an on-policy group baseline weighted by completion length.

"On-Policy RL with Optimal Reward Baseline", Yaru Hao, Li Dong et al., 2025.
https://arxiv.org/abs/2505.23585 — reference code: verl ``verl/trainer/ppo/core_algos.py``
``compute_opo_outcome_advantage``.

**Change vs GRPO**: the baseline is the length-weighted mean of the group's rewards (the
variance-optimal baseline when the gradient norm grows with length), and there is no std scaling.

**Math** (``L`` [B,G] completion lengths, valid rows only)::

    b_g = Σ_i L_i r_i / Σ_i L_i            (a single valid row: b = 0, verl's rule)
    adv = r - b_g

**Defaults**: none [CODE] (verl's ``epsilon`` argument is unused by this estimator).

**Notes**

1. Invalid rows (``group_valid`` False, NaN reward) get 0 and do not enter the baseline.
2. A group whose valid rows all have length 0 falls back to the plain mean (verl would divide by 0).
3. A constant group gets exactly 0 (b equals the common reward).
4. Computed in float64; a value beyond float32's range saturates at ±3.4e38.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import constant_group, group_mean, to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("advantage", "opo")
@dataclass
class OPO:
    """Reward minus the group's length-weighted mean reward (OPO, Hao et al. 2025)."""

    group_relative = True  # needs G >= 2: with one row per group every advantage is 0

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        r0 = torch.where(valid, r, torch.zeros(())).double()  # [B,G]
        L = (rollout.mask.sum(-1) * valid).double()  # [B,G]
        total = L.sum(1, keepdim=True)  # [B,1]
        weighted = (L * r0).sum(1, keepdim=True) / total.clamp(min=1)  # [B,1]
        baseline = torch.where(total > 0, weighted, group_mean(r0, valid).double())  # [B,1]
        baseline = torch.where(valid.sum(1, keepdim=True) == 1, torch.zeros(()), baseline)  # [B,1]
        # [B,G]
        adv = torch.where(constant_group(r, valid) & (valid.sum(1, keepdim=True) > 1), torch.zeros(()), r0 - baseline)
        return to_float32(torch.where(valid, adv, torch.zeros(())))  # [B,G]
