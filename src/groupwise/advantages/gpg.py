"""GPG advantage: group-centred reward rescaled by the batch's share of rows with a non-zero reward.

"GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning", Xiangxiang Chu et
al., 2025. https://arxiv.org/abs/2504.02546 — reference code: verl ``verl/trainer/ppo/core_algos.py``
``compute_gpg_outcome_advantage`` (its loss is ``losses/gpg.py``).

**Change vs GRPO**: no std scaling; instead every advantage is multiplied by α = N / M, where N
counts the batch's rows and M those with a non-zero reward, which undoes the dilution of the
gradient by rows that carry no signal.

**Math** (over the valid rows of the whole batch)::

    alpha = N / max(M, 1)          N = #valid rows, M = #valid rows with r != 0
    adv   = alpha * (r - mean_g(r)) / f_norm        (a single valid row: mean 0, verl's rule)

**Defaults**

- ``f_norm = 1.0`` [CODE] verl's default.

**Notes**

1. α is a whole-batch statistic (the estimator sees every rank's groups), as verl computes it over
   its batch. verl's ``alpha`` argument is overwritten by this formula in its code; so it is here.
2. Invalid rows get 0 and are not counted in N or M; a constant group of more than one row gets 0.
3. Computed in float64; a value beyond float32's range saturates at ±3.4e38.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import constant_group, group_mean, to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("advantage", "gpg")
@dataclass
class GPGAdvantage:
    """Group-centred reward times N/M, M = rows with a non-zero reward (GPG, Chu et al. 2025)."""

    f_norm: float = 1.0

    def __post_init__(self) -> None:
        if not self.f_norm > 0:
            raise ValueError(f"gpg: f_norm must be > 0, got {self.f_norm}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        r0 = torch.where(valid, r, torch.zeros(())).double()  # [B,G]
        n, m = valid.sum(), (valid & (r0 != 0)).sum()
        alpha = n.double() / m.clamp(min=1).double()  # []
        single = valid.sum(1, keepdim=True) == 1  # [B,1]
        mean = torch.where(single, torch.zeros(()), group_mean(r0, valid).double())  # [B,1]
        centred = torch.where(constant_group(r, valid) & ~single, torch.zeros(()), r0 - mean)  # [B,G]
        adv = alpha * centred / self.f_norm  # [B,G]
        return to_float32(torch.where(valid, adv, torch.zeros(())))  # [B,G]
