"""DAPO dynamic sampling: drop groups whose rewards are all equal and draw more prompts.

"DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Qiying Yu, Zheng Zhang,
Ruofei Zhu et al., 2025. https://arxiv.org/abs/2503.14476

**Change vs GRPO**: groups whose valid rewards are all equal (all correct or all wrong) have zero
group-relative advantage and give no gradient; DAPO over-samples and filters them out, so every
group in the batch carries signal. Drawing is the same as ``uniform``.

**Math** (per group, over valid rows ``group_valid & isfinite(r)``)::

    keep = max_g(r) > min_g(r)            (std > 0, without rounding)

**Defaults**

- ``max_rounds = 4`` [INFERRED] a cap on draw/generate/score rounds per step, the role of DAPO's
  (verl's) ``max_num_gen_batches``; the trainer draws until the batch is full or the cap is
  reached, then trims to B.
- ``shuffle = True`` as ``uniform``.

**Notes**

1. A group with fewer than two valid rows is dropped (it has no spread).
2. Kept groups are the same whatever the reward scale: the test is exact equality, not std > eps.
3. The state is ``uniform``'s (position, epoch): the filter itself is stateless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import constant_group
from groupwise.registry import register
from groupwise.sampling.uniform import UniformSampler
from groupwise.types import Rollout


@register("sampling", "dynamic")
@dataclass
class DynamicSampler(UniformSampler):
    """Keep only groups with non-identical rewards, redraw to fill (DAPO dynamic sampling, Yu et al. 2025)."""

    max_rounds: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_rounds < 1:
            raise ValueError(f"dynamic: max_rounds must be >= 1, got {self.max_rounds}")

    def keep(self, rollout: Rollout) -> Tensor:
        if rollout.rewards is None:
            raise ValueError("dynamic sampling needs rollout.rewards (score before keep)")
        r = rollout.rewards.float()  # [B,G]
        valid = rollout.group_valid.bool() & torch.isfinite(r)  # [B,G]
        return ~constant_group(r, valid)[:, 0]  # [B]
