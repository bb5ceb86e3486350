"""XGRPO: the group-relative advantage with a baseline pooled over several actors' rows for the prompt.

Mutual RL (Liu et al., arXiv 2605.07244; author blog https://xz-liu.github.io/blog/mutual-rl.html),
the cross-policy advantage-sharing probe. Spec: ``shared/specs/52-mutual-rl.md``.

**Change vs GRPO**: the mean and std that normalise a row's reward are not its own group's but the
pool of every actor's valid rows for the same prompt, given by the strategy as the group extras
``pooled_mean`` and ``pooled_std`` (``rollout/mutual.py``); each actor trains on its own rows only.

**Math** (``valid = group_valid & isfinite(r)``)::

    A_i = (r_i − μ_pool) / (σ_pool + eps)       σ_pool the population std of the pool   [B,G]
    A_i = λ_sgt · A_i                           on rows flagged ``injected`` (SGT's rescue rows)
    A_i = 0                                     invalid rows; and where σ_pool = 0 (a constant pool)

**Defaults** [INFERRED] (spec 52): the population std over all rows of both actors (the spec's
numbers: A's rewards [0,0,0,0], B's [1,1,0,0] → μ = 0.25, σ = 0.433013 → A_A = −0.57735 ×4);
``eps = 1e-6``; ``lambda_sgt = 1`` (the rescue rows' advantage scale). Where the strategy pools
nothing (``share`` other than ``"xgrpo"``) the extras are the group's own statistics: this is
``grpo`` with ``std = "population"``, over the augmented group under SGT (``[0,0,0,0,1]`` →
``[−0.5 ×4, 2.0]``).

**Notes**

1. ``group_relative`` is False: an actor's own group may be a single row, the pool is not.
2. A constant pool (σ = 0) gives exactly 0, as ``grpo``'s constant groups; invalid rows get 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import INJECTED, Rollout, StepInfo


@register("advantage", "xgrpo")
@dataclass
class XGRPOAdvantage:
    """(r − μ_pool) / (σ_pool + eps) with the strategy's pooled baseline (Mutual RL's XGRPO)."""

    group_relative = False  # the pool may hold other actors' rows: one row of one's own is enough
    eps: float = 1e-6
    lambda_sgt: float = 1.0  # scale of the advantages of injected (rescued) rows [INFERRED]

    rollout_extras = ("pooled_mean", "pooled_std")

    def __post_init__(self) -> None:
        if self.eps < 0:
            raise ValueError(f"xgrpo: eps must be >= 0, got {self.eps}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        missing = [k for k in self.rollout_extras if k not in rollout.extras]
        if missing:
            raise ValueError(
                f"xgrpo reads the group extras {missing}, which a pooling strategy sets (rollout.name='mutual')"
            )
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        mean = rollout.extras["pooled_mean"].double()[:, None]  # [B,1]
        std = rollout.extras["pooled_std"].double()[:, None]  # [B,1]
        adv = (r.double() - mean) / (std + self.eps)  # [B,G]
        adv = torch.where(rollout.flag(INJECTED), self.lambda_sgt * adv, adv)  # [B,G]
        keep = valid & (std > 0)  # [B,G] a constant pool teaches nothing
        return to_float32(torch.where(keep, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G]
