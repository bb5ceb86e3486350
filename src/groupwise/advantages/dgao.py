"""DGAO: dual group advantage — a question's accuracy across input orders against the batch, plus
each order's answer against the question's other orders.

"Towards Order Fairness: Mitigating LLMs Order Sensitivity through Dual Group Advantage
Optimization", Wang, Mo, Li, Chen, Chu, Tan, Li, 2026. https://arxiv.org/abs/2605.11974 — authors'
code github.com/Hyalinesky/DGAO, ``trl/trainer/dgao_trainer.py`` (``_calculate_hybrid_advantages``).
The groups of input-order permutations come from the rollout strategy ``dgao`` (``rollout/dgao.py``);
this estimator works on any groups.

**Change vs GRPO**

- No std scaling, and two baselines mixed: the group's mean reward against the mean over every
  group of the step (inter-group "stability" term), and each row against its group (intra-group).
- A group whose rows all succeed (the question answered in every order) keeps a positive
  advantage, where GRPO gives it 0; a group that fails in every order a negative one.

**Math** (``r`` [B,G]; ``valid`` = group_valid & finite r; groups = questions, rows = orders)::

    g     = mean_{valid rows} r                         # [B,1] group reward
    b     = mean_{groups with a valid row} g             # [] global baseline, over the whole step batch
    A_grp = g − b;   A_ind = r − g
    adv   = alpha · A_grp + (1 − alpha) · A_ind          # [B,G]

**Defaults**

- ``alpha = 0.5`` [CODE] ``DGAOTrainer(alpha=0.5)``; no std scaling [CODE].

**Notes**

1. With ``alpha = 0.5`` the group means cancel: adv = (r − b) / 2, a batch-mean baseline — the
   released code's default is REINFORCE with the step's mean reward as baseline, halved. ``alpha = 0``
   is Dr.GRPO's group-centred advantage; ``alpha = 1`` gives every row its group's A_grp.
2. With a single group in the step (the released code's per-device batch of 1 on one device)
   b = g and A_grp ≡ 0: batch several questions per step (``rollout.prompts_per_step``).
3. ``b`` is over the whole gathered batch (the released code gathers group rewards across
   processes), so it does not depend on the world size.
4. Invalid rows get exactly 0 and enter no mean; a group without valid rows is left out of ``b``.
5. ``step_stats``: ``dgao/baseline`` (b) and ``dgao/constant_adv`` (mean |adv| over the valid rows
   of groups whose rewards are all equal — 0 under GRPO).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import constant_group, group_mean, masked_mean, to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def dgao_advantages(rewards: Tensor, alpha: float = 0.5, valid: Tensor | None = None) -> Tensor:
    """The spec's interface: rewards [Q,O] (NaN = no verdict) -> [Q,O] float64 dual advantages (module Math)."""
    r = rewards.double()  # [Q,O]
    valid = torch.isfinite(r) if valid is None else valid & torch.isfinite(r)  # [Q,O]
    r = torch.nan_to_num(r)  # [Q,O]
    g = group_mean(r, valid)  # [Q,1]
    has = valid.any(1, keepdim=True)  # [Q,1]
    b = masked_mean(g, has)  # []
    adv = alpha * (g - b) + (1.0 - alpha) * (r - g)  # [Q,O]
    return torch.where(valid, adv, torch.zeros((), dtype=adv.dtype))  # [Q,O]


@register("advantage", "dgao")
@dataclass
class DGAO:
    """alpha·(group mean − batch mean) + (1 − alpha)·(r − group mean), no std (DGAO, Wang et al. 2026)."""

    alpha: float = 0.5
    _stats: dict = field(default_factory=dict, init=False, repr=False)

    group_relative = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"advantage dgao: alpha must be in [0, 1], got {self.alpha}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        adv = dgao_advantages(r, self.alpha, valid)  # [B,G] float64
        const = valid & constant_group(torch.nan_to_num(r), valid)  # [B,G]
        has = valid.any(1, keepdim=True)  # [B,1]
        self._stats = {
            "dgao/baseline": float(masked_mean(group_mean(torch.nan_to_num(r), valid), has)),
            "dgao/constant_adv": float(adv.abs()[const].mean()) if const.any() else 0.0,
        }
        return to_float32(adv)  # [B,G]

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
