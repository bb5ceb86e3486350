"""GRPO group-relative advantage.

"DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
Zhihong Shao, Peiyi Wang, Qihao Zhu et al., 2024. https://arxiv.org/abs/2402.03300

**Change vs GRPO**: this *is* GRPO's advantage (outcome supervision, §4.1.2 of the paper); the
``scale`` option also gives the batch-std variant (TRL ``scale_rewards="batch"``: group mean
centring, std of the whole batch's rewards; REINFORCE++-baseline is a different estimator, which
whitens the centred values) and the no-std variant of Dr.GRPO (``scale="none"``).

**Math** (``valid = group_valid & isfinite(r)``; every statistic over valid rows only)::

    adv = (r - mean_g(r)) / (std + eps)      std = std_g(r)  (scale="group")
                                             std = std_batch(r) (scale="batch")
    adv = r - mean_g(r)                      (scale="none")

**Defaults**

- ``scale="group"`` [PAPER] DeepSeekMath eq. for outcome supervision, r̃ = (r − mean(r)) / std(r).
- ``std="unbiased"`` [CODE] TRL ``GRPOTrainer`` and verl ``compute_grpo_outcome_advantage`` both
  call ``torch.std`` (Bessel-corrected); ``"population"`` divides by n instead (numpy).
- ``eps=1e-4`` [CODE] TRL adds 1e-4 to the std; verl uses 1e-6.

**Notes**

1. Invalid rows (``group_valid`` False or a NaN/inf reward) get exactly 0 and do not enter any
   statistic; the output is never NaN or inf. The statistics are float64, so rewards up to
   float32's largest (3.4e38) normalise correctly; ``scale="none"`` values beyond it saturate.
2. A group whose valid rewards are all equal (including a single valid row) gets exactly 0 — the
   centred value is forced to 0 instead of relying on ``r - mean`` rounding to 0.
3. ``scale="batch"`` takes the std of every valid reward of the step batch (all groups, not the
   centred values), computed once per step before micro-batching as DESIGN §2 requires.
4. ``group_normalize`` is the shared primitive (specs/README "Group statistics", in
   ``groupwise.masked`` with ``valid_rows``, ``constant_group`` and ``group_center``); ``dr_grpo`` and
   ``rloo`` are built on it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import GROUP_SCALES, constant_group, group_center, group_normalize, to_float32, valid_rows  # noqa: F401  (the shared primitives, re-exported)
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

_DDOF = {"unbiased": 1, "population": 0}


@register("advantage", "grpo")
@dataclass
class GRPOAdvantage:
    """Group-relative advantage, mean/std normalised (DeepSeekMath, Shao et al. 2024)."""

    group_relative = True  # needs G >= 2: with one row per group every advantage is 0

    scale: str = "group"  # "group" | "batch" | "none"
    std: str = "unbiased"  # "unbiased" (Bessel, torch.std) | "population"
    eps: float = 1e-4

    def __post_init__(self) -> None:
        if self.scale not in GROUP_SCALES:
            raise ValueError(f"grpo: scale must be one of {GROUP_SCALES}, got {self.scale!r}")
        if self.std not in _DDOF:
            raise ValueError(f"grpo: std must be one of {tuple(_DDOF)}, got {self.std!r}")
        if self.eps < 0:
            raise ValueError(f"grpo: eps must be >= 0, got {self.eps}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        adv = group_normalize(r, valid, self.scale, _DDOF[self.std], self.eps)  # [B,G] float64
        return to_float32(torch.where(valid, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G]
