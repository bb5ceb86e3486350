"""A plug-in objective term: PPO's clipped surrogate on an advantage clipped to [-adv_clip, adv_clip].

Not registered: term.toml names it by module and class, ``name = "my_term:ClippedAdvantagePPO"``,
and groupwise registers it in the objective stage under that name (docs/extending.md).

**Change vs GRPO**: a few rows with a large advantage (the one success in a group of failures) can
dominate a step; clipping the advantage bounds each row's weight in the update.

**Math** (per token; ``adv`` [b,G] broadcast over T)::

    a     = clip(adv, -adv_clip, adv_clip)
    ratio = exp(logp - logp_old)
    loss  = -min(ratio * a, clip(ratio, 1 - eps, 1 + eps) * a)

**Logged**: ``adv_clip/clipped_frac``, the share of the step's valid rows (token advantages: loss
tokens) whose advantage was clipped, computed once per step on the whole batch (``prepare``) and
logged by the trainer (``step_stats``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.types import Rollout, StepInfo


@dataclass
class ClippedAdvantagePPO:
    """PPO clipped surrogate with the advantage clipped to [-adv_clip, adv_clip] (example plug-in)."""

    adv_clip: float = 1.0
    eps: float = 0.2
    coef: float = 1.0  # the term's weight in the objective
    agg: str | None = None  # its aggregation (None: the objective's default)

    needs = ()  # model outputs beyond the policy's log-probs: none

    def __post_init__(self) -> None:
        if not self.adv_clip > 0:
            raise ValueError(f"my_term: adv_clip must be > 0, got {self.adv_clip}")
        self.clipped_frac = 0.0

    def prepare(self, batch: Rollout, info: StepInfo) -> None:
        adv = batch.advantages  # [B,G] or [B,G,T]
        where = batch.group_valid if adv.dim() == 2 else batch.mask & batch.group_valid[..., None]  # [B,G(,T)]
        self.clipped_frac = float((adv.abs() > self.adv_clip)[where].float().mean()) if where.any() else 0.0

    def step_stats(self) -> dict[str, float]:
        return {"adv_clip/clipped_frac": self.clipped_frac}

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        adv = mb.advantages.clamp(-self.adv_clip, self.adv_clip)  # [b,G] or [b,G,T]
        adv = adv[..., None] if adv.dim() == 2 else adv  # [b,G,1] or [b,G,T]
        log_ratio = (out["logp"] - mb.logp_old).masked_fill(~mb.mask, 0.0)  # [b,G,T] padding never overflows
        ratio = log_ratio.exp()  # [b,G,T]
        return -torch.min(ratio * adv, ratio.clamp(1 - self.eps, 1 + self.eps) * adv)  # [b,G,T]
