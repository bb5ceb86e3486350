"""ReMax advantage: the sample's reward minus the reward of the prompt's greedy completion.

"ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large
Language Models", Ziniu Li, Tian Xu, Yushun Zhang, Zhihang Lin, Yang Yu, Ruoyu Sun, Zhi-Quan Luo,
2023, https://arxiv.org/abs/2310.10505 (Eq. 5: the REINFORCE gradient with baseline
``b(x) = r(x, ȳ)``, ȳ the greedy response). verl: ``compute_remax_outcome_advantage`` in
``verl/trainer/ppo/core_algos.py`` (token returns of an outcome reward minus ``reward_baselines``,
no whitening).

**Change vs GRPO**: the baseline is the reward of a second generation request — the prompt's
greedy completion, collected by the rollout strategy ``remax`` — instead of the group's mean, and
there is no std division. It needs no group: ``group_size = 1`` works (the paper's setting).

**Math** (``b_g`` = ``rollout.extras["baseline_reward"]`` of group g)::

    adv_{g,i} = r_{g,i} − b_g

**Defaults**: none (no hyper-parameters) [PAPER].

**Notes**

1. With an outcome reward verl's token returns are ``r`` at every completion token, so its token
   advantage is this row value broadcast over the row; the row form is returned here.
2. A group whose greedy reward was excluded (NaN: no verdict) has no baseline: its rows get 0.
3. Invalid rows get exactly 0. Computed in float64 (a difference of two float32 rewards may exceed
   float32's range); a value beyond it saturates at ±3.4e38.
4. Reads an extra that only ``rollout.name = "remax"`` collects; any other strategy fails at build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("advantage", "remax")
@dataclass
class ReMaxAdvantage:
    """Reward minus the greedy completion's reward ``r_i − r(ȳ)`` (ReMax, Li et al. 2023)."""

    group_relative = False  # the baseline is the greedy row: one sample per prompt is enough
    rollout_extras = ("baseline_reward",)

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if "baseline_reward" not in rollout.extras:
            raise ValueError(
                "advantage 'remax' needs rollout.extras['baseline_reward'], which rollout.name='remax' collects"
            )
        r, valid = valid_rows(rollout)  # [B,G], [B,G] float64
        baseline = rollout.extras["baseline_reward"].double()[:, None]  # [B,1]
        keep = valid & torch.isfinite(baseline)  # [B,G] rows with a sample and a baseline
        adv = torch.where(keep, r - torch.nan_to_num(baseline), torch.zeros((), dtype=r.dtype))  # [B,G]
        return to_float32(adv)  # [B,G]
