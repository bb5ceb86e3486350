"""GDPO: normalise each reward function within its group, then sum (multi-reward GRPO).

"GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
Optimization", Shih-Yang Liu et al. (NVIDIA), 2026, https://arxiv.org/abs/2601.05242. The
reference implementation read is TRL 1.16's ``GRPOTrainer._generate_and_score_completions``
(``multi_objective_aggregation="normalize_then_sum"``, ``trl/trainer/grpo_trainer.py``).

**Change vs GRPO**: GRPO (and TRL's default ``sum_then_normalize``) first sums the weighted
rewards, then normalises the sum within the group, so a reward with a large spread drowns the
others and distinct reward combinations collapse onto one advantage. GDPO normalises every reward
function on its own within the group, sums the weighted z-scores, and whitens the sum over the batch.

**Math** (``r_k`` [B,G] the k-th reward function's values, ``w_k`` its weight; rows that are
invalid or have no verdict from function k do not enter its statistics)::

    z_k = (r_k − mean_g(r_k)) / (std_g(r_k) + eps)          per group, std with Bessel's correction
    s   = Σ_k w_k · z_k                                    a missing z_k counts as 0 (TRL's nansum)
    A   = (s − mean_batch(s)) / (std_batch(s) + eps)        over the step's valid rows (batch_norm)

**Defaults**

- ``eps = 1e-4`` [CODE] TRL ``(std + 1e-4)`` in both normalisations.
- ``batch_norm = True`` [CODE] TRL whitens the summed z-scores over the batch; ``False`` keeps s.
- ``ddof = 1`` [CODE] TRL's ``nanstd`` applies Bessel's correction.

**Notes**

1. Reads ``rollout.reward_parts`` [B,G,K] (unweighted, NaN = no verdict) and the group-level extra
   ``reward_weights`` [B,K] that the reward stage writes (a rollout without them is one reward,
   ``rewards``); with one reward function it is GRPO followed by batch whitening.
2. A group whose values of function k are all equal (or that has fewer than 2 of them) gets z_k = 0
   (TRL: 0 / (0 + eps), or NaN skipped by its nansum — the same sum).
3. Invalid rows get exactly 0; statistics are float64, the output float32 (saturating at ±3.4e38).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import batch_std, group_normalize, masked_mean, to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("advantage", "gdpo")
@dataclass
class GDPOAdvantage:
    """Normalise each reward function within its group, sum the weighted z-scores, whiten over the batch (GDPO, Liu et
    al. 2026; TRL normalize_then_sum)."""

    eps: float = 1e-4
    batch_norm: bool = True
    ddof: int = 1

    group_relative = True

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        _, valid = valid_rows(rollout)  # [B,G] rows with a finite total
        # one reward: the total is its only part
        if rollout.reward_parts is None or "reward_weights" not in rollout.extras:
            parts, weights = (
                rollout.rewards.double()[..., None],
                torch.ones(valid.shape[0], 1, dtype=torch.float64),
            )  # [B,G,1], [B,1]
        else:
            parts, weights = rollout.reward_parts.double(), rollout.extras["reward_weights"].double()  # [B,G,K], [B,K]
        total = torch.zeros(valid.shape, dtype=torch.float64)  # [B,G]
        for k in range(parts.shape[-1]):
            seen = valid & torch.isfinite(parts[..., k])  # [B,G] rows with a verdict from function k
            # [B,G] 0 outside `seen`
            z = group_normalize(torch.nan_to_num(parts[..., k]), seen, "group", self.ddof, self.eps)
            total = total + weights[:, k : k + 1] * z  # [B,G]
        if self.batch_norm:
            total = (total - masked_mean(total, valid)) / (batch_std(total, valid, self.ddof) + self.eps)  # [B,G]
        return to_float32(torch.where(valid, total, torch.zeros((), dtype=total.dtype)))  # [B,G]
