"""KL penalty in the reward (a rollout scorer), as in PPO-RLHF.

"Fine-Tuning Language Models from Human Preferences", Daniel M. Ziegler, Nisan Stiennon, Jeffrey
Wu et al., 2019, https://arxiv.org/abs/1909.08593 (reward r − β·KL); estimators from Schulman,
"Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html.

**Change vs GRPO**: GRPO puts the KL in the loss (objective term ``kl``); this scorer puts it in
the reward instead, so it is centred and scaled with the task reward by the advantage estimator.

**Math** (``logp_old`` = the sampling policy's log-probs, filled by the trainer before scorers run;
``mask = rollout.row_mask``, the completion tokens of valid rows)::

    score = -coef * Σ_t mask · kl(logp_old, logp_ref)          # [B,G]

**Defaults**

- ``coef = 0.05`` [CODE] TRL ``PPOConfig.kl_coef``.
- ``estimator = "k1"`` [CODE] TRL ``PPOConfig.kl_estimator``: k1 is unbiased for the sequence KL
  and its per-token sum is the log-ratio of the sequence, which is what a reward should carry.
- ``weight = 1.0`` (the trainer multiplies every reward component by its weight) [CODE] TRL
  ``GRPOConfig.reward_weights = None`` weighs every reward 1.0.

**Notes**

1. A *rollout scorer*: it has ``score_rollout(rollout, info)`` and no ``__call__``; the trainer
   tells text rewards from scorers by ``hasattr(c, "score_rollout")``.
2. Invalid rows (``group_valid`` False) score 0; tokens outside ``rollout.mask`` contribute 0,
   whatever their log-probs hold.
3. No gradient: the log-probs are no-grad needs computed once per step.
4. ``estimator`` is any name of stage ``kl`` (``k1``, ``k2``, ``k3``), built at construction; a
   rollout without ``logp_old`` or ``logp_ref`` is a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.kl_estimators import token_kl
from groupwise.registry import build, register
from groupwise.types import Need, Rollout, StepInfo


@register("reward", "kl_penalty")
@dataclass
class KLPenalty:
    """Reward −coef·Σ_t KL(π_old ‖ π_ref) per completion, k1 by default (PPO-RLHF, Ziegler et al. 2019)."""

    coef: float = 0.05
    estimator: str = "k1"
    weight: float = 1.0

    needs = (Need("logp", "ref"), Need("logp", "policy"))

    def __post_init__(self) -> None:
        self._kl = build("kl", self.estimator)

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if rollout.logp_old is None or rollout.logp_ref is None:
            raise ValueError("kl_penalty needs rollout.logp_old and rollout.logp_ref (declared in its needs)")
        mask = rollout.row_mask.bool()  # [B,G,T]
        with torch.no_grad():
            kl = token_kl(self._kl, rollout.logp_old, rollout.logp_ref, mask)  # [B,G,T]
            return -self.coef * kl.sum(-1)  # [B,G]
