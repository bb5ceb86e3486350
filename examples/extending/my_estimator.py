"""A plug-in advantage estimator: GRPO's group-mean baseline, divided by a running std of the rewards.

Imported by ``plugins = ["my_estimator"]`` (estimator.toml); ``@register`` adds ``running_std`` to
the advantage stage, so a recipe names it like a built-in estimator (docs/extending.md).

**Change vs GRPO**: GRPO divides each group's centred rewards by that group's own std, so a group in
which one row of eight succeeded gets as large advantages as one in which four did. Here every
group is divided by one scale: the std of the whole batch's rewards, averaged over steps.

**Math** (``valid`` = real rows with a finite reward; step ``k``)::

    centred = r - mean_g(r)                         over the group's valid rows
    s_k     = std(r)                                population std over the batch's valid rows
    ema_k   = s_0 at the first step, else beta * ema_{k-1} + (1 - beta) * s_k
    adv     = centred / (ema_k + eps)               0 on invalid rows

**State**: ``ema`` (``state_dict`` / ``load_state_dict``), so a resumed run scales its advantages
exactly as the uninterrupted run does. The trainer calls an estimator once per step, on the whole
batch (every rank the same), so ``ema`` is the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("advantage", "running_std")
@dataclass
class RunningStd:
    """Group-mean baseline divided by a running (EMA) std of the batch rewards (example plug-in)."""

    beta: float = 0.9  # weight of the past in the running std
    eps: float = 1e-6
    ema: float | None = field(default=None, init=False)  # the running std (state, not a parameter)

    group_relative = True  # with one row per group every advantage is 0: the trainer refuses group_size 1

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r = rollout.rewards.double()  # [B,G]
        valid = rollout.group_valid & torch.isfinite(r)  # [B,G]
        r = torch.where(valid, r, torch.zeros(()))  # [B,G] invalid rows out of every sum
        count = valid.sum(1, keepdim=True).clamp(min=1)  # [B,1]
        centred = r - r.sum(1, keepdim=True) / count  # [B,G]
        s = float(r[valid].std(unbiased=False)) if valid.any() else 0.0
        self.ema = s if self.ema is None else self.beta * self.ema + (1 - self.beta) * s
        adv = torch.where(valid, centred / (self.ema + self.eps), torch.zeros(()))  # [B,G]
        return adv.float()  # [B,G]

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = state["ema"]
