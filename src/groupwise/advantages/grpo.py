"""GRPO group-relative advantage.

"DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
Zhihong Shao, Peiyi Wang, Qihao Zhu et al., 2024. https://arxiv.org/abs/2402.03300

**Change vs GRPO**: this *is* GRPO's advantage (outcome supervision, §4.1.2 of the paper); the
``scale`` option also gives the batch-std variant (REINFORCE++-baseline style, TRL
``scale_rewards="batch"``) and the no-std variant of Dr.GRPO (``scale="none"``).

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
   statistic; the output is never NaN or inf.
2. A group whose valid rewards are all equal (including a single valid row) gets exactly 0 — the
   centred value is forced to 0 instead of relying on ``r - mean`` rounding to 0.
3. ``scale="batch"`` takes the std of every valid reward of the step batch (all groups, not the
   centred values), computed once per step before micro-batching as DESIGN §2 requires.
4. ``group_normalize`` is the shared primitive (specs/README "Group statistics") other
   estimators import; ``dr_grpo`` and ``rloo`` are built on ``group_center``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import batch_std, group_mean, group_std
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

_DDOF = {"unbiased": 1, "population": 0}
_SCALES = ("group", "batch", "none")


def valid_rows(rollout: Rollout) -> tuple[Tensor, Tensor]:
    """(rewards [B,G] float32, valid [B,G] bool): the rows that enter group statistics."""
    if rollout.rewards is None:
        raise ValueError("advantage estimators need rollout.rewards; run the reward stage first")
    r = rollout.rewards.float()  # [B,G]
    if r.dim() != 2:
        raise ValueError(f"advantage estimators expect rewards [B,G], got {tuple(r.shape)}")
    valid = rollout.group_valid.bool() & torch.isfinite(r)  # [B,G]
    return r, valid


def constant_group(r: Tensor, valid: Tensor) -> Tensor:
    """[B,1] bool: the group's valid rewards are all equal (true for 0 or 1 valid rows)."""
    hi = torch.where(valid, r, torch.full_like(r, -torch.inf)).amax(1, keepdim=True)  # [B,1]
    lo = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(1, keepdim=True)  # [B,1]
    return ~(hi > lo)  # [B,1]


def group_center(r: Tensor, valid: Tensor) -> Tensor:
    """[B,G] r - mean_g(r) over valid rows; exactly 0 for invalid rows and constant groups."""
    centred = r - group_mean(r, valid)  # [B,G]
    keep = valid & ~constant_group(r, valid)  # [B,G]
    return torch.where(keep, centred, torch.zeros((), dtype=r.dtype))  # [B,G]


def group_normalize(r: Tensor, valid: Tensor, scale: str | None = "group", ddof: int = 1, eps: float = 1e-4) -> Tensor:
    """[B,G] -> [B,G] centred by the group mean, divided by the group / batch std (+eps) or not at all."""
    centred = group_center(r, valid)  # [B,G]
    if scale in (None, "none"):
        return centred
    if scale == "group":
        std = group_std(r, valid, ddof)  # [B,1]
    elif scale == "batch":
        std = batch_std(r, valid, ddof)  # []
    else:
        raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
    denom = std + eps  # [B,1] or []
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))  # eps=0 and std=0 only for constant groups (centred 0)
    return centred / denom  # [B,G]


@register("advantage", "grpo")
@dataclass
class GRPOAdvantage:
    """Group-relative advantage, mean/std normalised (DeepSeekMath, Shao et al. 2024)."""

    scale: str = "group"  # "group" | "batch" | "none"
    std: str = "unbiased"  # "unbiased" (Bessel, torch.std) | "population"
    eps: float = 1e-4

    def __post_init__(self) -> None:
        if self.scale not in _SCALES:
            raise ValueError(f"grpo: scale must be one of {_SCALES}, got {self.scale!r}")
        if self.std not in _DDOF:
            raise ValueError(f"grpo: std must be one of {tuple(_DDOF)}, got {self.std!r}")
        if self.eps < 0:
            raise ValueError(f"grpo: eps must be >= 0, got {self.eps}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        adv = group_normalize(r, valid, self.scale, _DDOF[self.std], self.eps)  # [B,G]
        return torch.where(valid, adv, torch.zeros((), dtype=adv.dtype))  # [B,G]
