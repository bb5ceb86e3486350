"""Dr.GRPO advantage: group mean baseline, no std division.

"Understanding R1-Zero-Like Training: A Critical Perspective", Zichen Liu, Changyu Chen, Wenjun Li,
Penghui Qi, Tianyu Pang, Chao Du, Wee Sun Lee, Min Lin, 2025. https://arxiv.org/abs/2503.20783

**Change vs GRPO**

- The advantage drops the division by the group std (the "question-level difficulty bias": groups
  with a small std, i.e. very easy or very hard prompts, get up-weighted by GRPO).
- (The paper's other change, a constant loss normaliser instead of 1/|o_i|, lives in the
  ``constant`` aggregation, not here.)

**Math** (``valid = group_valid & isfinite(r)``)::

    adv = r - mean_g(r)

**Defaults**: none (no hyper-parameters) [PAPER].

**Notes**

1. Identical to ``grpo(scale="none")`` by construction: both call ``group_normalize(scale=None)``;
   ``tests/test_equivalences.py`` checks it bit for bit.
2. Invalid rows and constant groups get exactly 0.
3. Computed in float64; a value beyond float32's range (|r − mean| > 3.4e38) saturates at ±3.4e38.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import group_normalize, to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("advantage", "dr_grpo")
@dataclass
class DrGRPOAdvantage:
    """Group-mean-centred advantage without std scaling (Dr.GRPO, Liu et al. 2025)."""

    group_relative = True  # needs G >= 2: with one row per group every advantage is 0

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        adv = group_normalize(r, valid, scale=None)  # [B,G] float64
        return to_float32(torch.where(valid, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G]
