"""LoPE advantage shaping: the GRPO statistics of a rescued group are taken over all its G + G' rewards.

"Nonsense Helps: Prompt Space Perturbation Broadens Reasoning Exploration", Langlin Huang, Chengsong
Huang, Jinyuan Li, Donghong Cai, Yuyi Yang, Jiaxin Huang, 2026. https://arxiv.org/abs/2605.05566 —
spec 61. Code read: https://github.com/shrango/LoPE ``verl/trainer/core_algos.py``
(``compute_grpo_outcome_advantage`` with ``all_rollout_scores_per_uid``, ``advantage_shaping``).

**Change vs GRPO**: the rollout strategy ``lope`` swaps correct resamples (sampled under
Lorem-perturbed prompts) into all-wrong groups, so a rescued group's own rows over-represent
success (``[1, 1, 1, 0]`` where 6 of 28 samples were right). With ``shaping`` the group mean and
std are taken over the group's rows **and** the rewards the strategy hands on in the group extra
``lope_extra_rewards`` (the replaced originals and the resamples not swapped in): together the full
G + G' reward vector, so a rare success keeps a large advantage. Groups without extra rewards get
GRPO's advantage unchanged.

**Math** (``valid = group_valid & isfinite(r)``; ``x`` = the finite entries of the group extra)::

    pool_b = {r_bg : valid} ∪ {x_bk : isfinite}
    adv_bg = (r_bg − mean(pool_b)) / (std(pool_b) + eps)     std with ddof 1 (torch.std)
           = 0 for invalid rows and for a constant pool

Spec 61's example: base ``[0, 0, 0, 0]`` plus 24 resamples of which 6 are right, regrouped to
``[1, 1, 1, 0]``: the pool is 6 ones and 22 zeros, mean 0.214286, std 0.417855, so A(correct) =
1.880350 and A(fail) = −0.512823 (GRPO on ``[1, 1, 1, 0]`` alone: 0.5 and −1.5).

**Defaults**

- ``shaping = True`` [CODE] the LoPE recipe's ``algorithm.advantage_shaping``; ``False`` is GRPO.
- ``std = "unbiased"`` [CODE] ``torch.std`` (ddof 1); ``"population"`` divides by n.
- ``eps = 1e-6`` [CODE] ``compute_grpo_outcome_advantage(eps=1e-6)``.

**Notes**

1. The extra rewards never get an advantage of their own (they are not rows of the batch); they only
   move the group's mean and std. Non-finite entries (NaN padding, an excluded resample) are left out.
2. A group extra of shape [B] (one extra reward per group) is read as [B, 1].
3. Statistics are float64 (``groupwise.masked``), so rewards up to float32's largest stay finite.
4. The estimator reads ``lope_extra_rewards`` (``rollout_extras``): a run whose rollout strategy does
   not collect it (anything but ``rollout.name = "lope"``) fails at build, also with ``shaping =
   False`` (the ablation inside a LoPE run; elsewhere use ``grpo`` with ``eps = 1e-6``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import group_normalize, to_float32, valid_rows
from groupwise.registry import register
from groupwise.rollout.lope import EXTRA
from groupwise.types import Rollout, StepInfo

_DDOF = {"unbiased": 1, "population": 0}


@register("advantage", "lope")
@dataclass
class LoPEAdvantage:
    """GRPO whose group mean/std include the strategy's extra rewards: the full G + G' vector of a rescued group
    (LoPE)."""

    group_relative = True
    rollout_extras = (EXTRA,)  # collected by rollout.name = "lope" only (note 4)

    shaping: bool = True
    std: str = "unbiased"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.std not in _DDOF:
            raise ConfigError(f"advantage lope: std={self.std!r} must be one of {tuple(_DDOF)}")
        if not self.eps >= 0:
            raise ConfigError(f"advantage lope: eps={self.eps} must be >= 0")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G] float64, [B,G]
        B, G = r.shape
        pool, pool_valid = r, valid
        if self.shaping and EXTRA in rollout.extras:
            x = rollout.extras[EXTRA].double().reshape(B, -1)  # [B,E]
            pool = torch.cat([r, x], dim=1)  # [B,G+E]
            pool_valid = torch.cat([valid, torch.isfinite(x)], dim=1)  # [B,G+E]
        adv = group_normalize(pool, pool_valid, "group", _DDOF[self.std], self.eps)[:, :G]  # [B,G] float64
        return to_float32(torch.where(valid, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G]
