"""AGPO: a fixed negative advantage for every wrong rollout, positive advantages scaled by the group's variance.

"AGPO: Asymmetric Group Policy Optimization for Verifiable Reasoning and Search Ads Relevance at
JD", Yang Xu, Kun Yao, Yiming Deng, Zheng Fang, Kai Ming Ting, Ming Pang, 2026.
https://arxiv.org/abs/2605.05826 (spec: specs/59; abstract only, no code, full paper not read).

**Change vs GRPO**

- Negative-dominant: a wrong rollout always gets ``-lam_neg``, not a group-normalised value, so
  all-fail groups (zero advantage under GRPO) still push their wrong answers down.
- Positive updates are scaled by the group's success rate: large for a rare correct answer, near
  zero for a group that is almost always right, exactly zero for an all-correct group.

**Math** (per group over its valid rows; ``correct_i = r_i >= threshold``)::

    p      = mean_g(correct)                               (p-hat, the group success rate)
    adv_i  = -lam_neg                                       if not correct_i
    adv_i  = lam_pos · (1 - p) / sqrt(p · (1 - p) + eps)    if correct_i, pos_scale = "std"
           = lam_pos · (1 - p)                              if correct_i, pos_scale = "variance"

With binary rewards the ``std`` form is GRPO's (population-std) normalised positive advantage,
``sqrt((1 - p) / p)``: 1.732 at p = 1/4, 1 at p = 1/2, 0.577 at p = 3/4, 0 at p = 1.

**Defaults**

- Negative-dominant reinforcement and variance-scaled positive updates [ABSTRACT].
- The two formulas above, ``pos_scale = "std"`` [INFERRED] (specs/59); ``"variance"`` is the
  spec's ablation alternative [INFERRED].
- ``lam_neg = 1.0``, ``lam_pos = 1.0`` [INFERRED]; ``eps = 1e-8`` [INFERRED].
- ``threshold = 0.5`` [INFERRED] non-binary rewards count as correct at >= 0.5.

**Notes**

1. Rows with ``group_valid`` False or a NaN reward get exactly 0 and do not enter p.
2. A group with one valid row gets -lam_neg (wrong) or 0 (right, p = 1).
3. Not zero-mean: every group with a wrong rollout pushes the policy's mass away from it, which is
   the method's point (the abstract: suppress incorrect paths to keep the base model's exploration).
4. ``step_stats`` logs ``agpo/all_fail_frac`` (share of groups with a valid row and p = 0: the
   groups that train only under AGPO) and ``agpo/pos_mean`` (mean positive advantage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

POS_SCALES = ("std", "variance")


def agpo_advantages(
    rewards: Tensor,
    valid: Tensor,
    lam_pos: float = 1.0,
    lam_neg: float = 1.0,
    eps: float = 1e-8,
    pos_scale: str = "std",
    threshold: float = 0.5,
) -> Tensor:
    """[B,G] float64 AGPO advantages of ``rewards`` [B,G] over ``valid`` rows (0 elsewhere)."""
    correct = valid & (rewards >= threshold)  # [B,G]
    n = valid.sum(1, keepdim=True).double()  # [B,1]
    p = correct.sum(1, keepdim=True).double() / n.clamp(min=1)  # [B,1]
    if pos_scale == "std":
        pos = lam_pos * (1 - p) / (p * (1 - p) + eps).sqrt()  # [B,1]
    else:
        pos = lam_pos * (1 - p)  # [B,1]
    adv = torch.where(correct, pos.expand_as(rewards), torch.full_like(rewards, -lam_neg, dtype=torch.float64))  # [B,G]
    return torch.where(valid, adv, torch.zeros((), dtype=adv.dtype))  # [B,G]


@register("advantage", "agpo")
@dataclass
class AGPOAdvantage:
    """Fixed -lam_neg for wrong rollouts, success-rate-scaled positives (AGPO, Xu et al. 2026)."""

    lam_pos: float = 1.0
    lam_neg: float = 1.0
    eps: float = 1e-8
    pos_scale: str = "std"  # "std" | "variance"
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.pos_scale not in POS_SCALES:
            raise ConfigError(f"agpo: pos_scale={self.pos_scale!r}; choose one of {POS_SCALES}")
        if self.eps <= 0:
            raise ConfigError(
                f"agpo: eps={self.eps} must be > 0 (it keeps sqrt(p(1-p)) away from 0 in all-correct groups)"
            )
        self._stats: dict[str, float] = {}

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        adv = agpo_advantages(r, valid, self.lam_pos, self.lam_neg, self.eps, self.pos_scale, self.threshold)  # [B,G]
        present = valid.any(1)  # [B]
        all_fail = present & ~(valid & (r >= self.threshold)).any(1)  # [B]
        pos = valid & (r >= self.threshold)  # [B,G]
        self._stats = {
            "agpo/all_fail_frac": float(all_fail.sum()) / max(int(present.sum()), 1),
            "agpo/pos_mean": float(adv[pos].mean()) if pos.any() else float("nan"),
        }
        return to_float32(adv)  # [B,G]

    def step_stats(self) -> dict[str, float]:
        """The last batch's share of all-fail groups and mean positive advantage (whole batch)."""
        return dict(self._stats)
