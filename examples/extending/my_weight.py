"""A plug-in token weight: later tokens of a completion count less, ``w_t = gamma ** t``.

Imported by ``plugins = ["my_weight"]`` (weight.toml); ``@register`` adds ``position_decay`` to the
weight stage (docs/extending.md). Token weights multiply every objective term that takes them.

**Change vs GRPO**: the first tokens of an answer decide most of it (the leading digits of a sum);
this weights them up relative to the tail.

**Math** (``t`` = the token's position in the completion, from 0)::

    w[b, g, t] = gamma ** t

**Logged**: ``position_decay/mean``, the mean weight over the step's loss tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("weight", "position_decay")
@dataclass
class PositionDecay:
    """Token weight gamma ** t over the completion's positions (example plug-in)."""

    gamma: float = 0.9

    needs = ()

    def __post_init__(self) -> None:
        if not 0 < self.gamma <= 1:
            raise ValueError(f"position_decay: gamma must be in (0, 1], got {self.gamma}")
        self.mean = 0.0

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        B, G, T = rollout.mask.shape
        w = (self.gamma ** torch.arange(T, dtype=torch.float32)).expand(B, G, T)  # [B,G,T]
        counted = rollout.mask & rollout.group_valid[..., None]  # [B,G,T]
        self.mean = float(w[counted].mean()) if counted.any() else 0.0
        return w  # [B,G,T]

    def step_stats(self) -> dict[str, float]:
        return {"position_decay/mean": self.mean}
