"""REINFORCE++ and REINFORCE++-baseline: returns (or group-centred rewards) whitened over the batch.

"REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and Reward Models", Jian Hu
et al., 2025. https://arxiv.org/abs/2501.03262 — reference code: verl
``verl/trainer/ppo/core_algos.py`` ``compute_reinforce_plus_plus_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` (with ``verl.utils.torch_functional.masked_whiten``).

**Change vs GRPO**

- ``reinforce_pp``: no group baseline at all; the per-token discounted return of the outcome reward
  is whitened with the mean and std of EVERY loss token of the batch (a global baseline).
- ``reinforce_pp_baseline``: the group mean is subtracted (as GRPO), then the centred values are
  whitened over every token of the batch instead of divided by the group std.

**Math** (``r`` [B,G] outcome reward on the last completion token, ``L`` its length, ``m`` the valid tokens)::

    reinforce_pp:           R_t = gamma^(L-1-t) * r                     (return from token t; gamma = 1: r)
    reinforce_pp_baseline:  R_t = r - mean_g(r)     (a single valid row: mean 0, verl's rule)
    adv_t = (R_t - mean_m(R)) / sqrt(var_m(R) + 1e-8)       var unbiased (n - 1), over the batch's tokens

**Defaults**

- ``gamma = 1.0`` [CODE] verl ``algorithm.gamma`` default.
- whitening eps ``1e-8`` and the unbiased variance [CODE] verl ``masked_whiten`` / ``masked_var``.

**Notes**

1. Token-level output [B,G,T], 0 on invalid rows and masked tokens. Whitening shifts the mean, so a
   constant group does NOT get exactly 0 (unlike ``grpo``): this is verl's behaviour.
2. The statistics are over the step's whole batch (all ranks: the estimator's whole-batch scope), so
   the result does not depend on the world size. With fewer than 2 valid tokens the values are only centred.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import group_mean, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + eps) over ``mask`` (unbiased var, verl's masked_whiten); 0 outside."""
    n = mask.sum().double()  # []
    values = torch.where(mask, x.double(), torch.zeros((), dtype=torch.float64))  # [...]
    mean = values.sum() / n.clamp(min=1)  # []
    centred = torch.where(mask, values - mean, torch.zeros((), dtype=torch.float64))  # [...]
    if n < 2:
        return centred.float()
    var = (centred**2).sum() / (n - 1)  # [] = masked_mean(centred²) · n/(n−1)
    return (centred * torch.rsqrt(var + eps)).float()  # [...]


def _token_mask(rollout: Rollout, valid: Tensor) -> Tensor:
    return rollout.mask.bool() & valid[..., None]  # [B,G,T]


@register("advantage", "reinforce_pp")
@dataclass
class ReinforcePP:
    """Discounted outcome return whitened over the batch's tokens, no baseline (REINFORCE++, Hu et al. 2025)."""

    gamma: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"reinforce_pp: gamma must be in (0, 1], got {self.gamma}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        mask = _token_mask(rollout, valid)  # [B,G,T]
        T = mask.shape[-1]
        last = mask.sum(-1, keepdim=True) - 1  # [B,G,1] index of the last token
        steps_to_end = (last - torch.arange(T)).clamp(min=0).double()  # [B,G,T]
        returns = torch.where(valid, r, torch.zeros(())).double()[..., None] * self.gamma**steps_to_end  # [B,G,T]
        return masked_whiten(returns, mask)  # [B,G,T]


@register("advantage", "reinforce_pp_baseline")
@dataclass
class ReinforcePPBaseline:
    """Group-mean-centred reward whitened over the batch's tokens (REINFORCE++-baseline, Hu et al. 2025)."""

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        r0 = torch.where(valid, r, torch.zeros(())).double()  # [B,G]
        single = valid.sum(1, keepdim=True) == 1  # [B,1] verl: a lone sample's baseline is 0
        mean = torch.where(single, torch.zeros(()), group_mean(r0, valid).double())  # [B,1]
        centred = (r0 - mean)[..., None].expand(rollout.mask.shape)  # [B,G,T]
        return masked_whiten(centred, _token_mask(rollout, valid))  # [B,G,T]
