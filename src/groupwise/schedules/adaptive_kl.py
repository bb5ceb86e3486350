"""Adaptive KL controller (PPO-RLHF): the KL coefficient follows the observed KL towards a target.

"Fine-Tuning Language Models from Human Preferences", Daniel M. Ziegler, Nisan Stiennon, Jeffrey
Wu et al., 2019, https://arxiv.org/abs/1909.08593 (§2.2, "we vary β dynamically"). Code: verl
``verl/trainer/ppo/core_algos.py`` ``AdaptiveKLController`` (updated in ``ray_trainer.py``
``apply_kl_penalty``); TRL ≤ 0.11 ``trl/trainer/utils.py`` ``AdaptiveKLController`` (updated in
``PPOTrainer.step``). TRL 1.16 has no adaptive controller.

**Change vs GRPO**: GRPO's KL coefficient is a constant; here it is multiplied up while the policy's
KL to the reference exceeds ``target`` and down while it is below. A controller (stage
``schedule``) for any coefficient, usually the KL-in-reward scorer's::

    rewards = ["exact", { name = "kl_penalty", coef = { schedule = "adaptive_kl", target = 6.0, horizon = 10000 } }]

**Math** (``kl_t`` = ``estimator(logp_old, logp_ref)`` per token on the step's whole batch; ``rows`` =
its valid rows; ``n_steps`` = #rows unless given)::

    KL       = mean_rows Σ_t mask·kl_t                       level = "sequence" (TRL)
             = mean_rows (Σ_t mask·kl_t / Σ_t mask)          level = "token_mean" (verl)
    e        = clip(KL / target − 1, −clip, clip)
    value   ← value · (1 + e · n_steps / horizon)

**Defaults**

- ``init = 0.2``, ``target = 6.0``, ``horizon = 10000`` [CODE] TRL ``PPOConfig`` (``init_kl_coef``,
  ``target``, ``horizon``); verl ``KLControlConfig``: ``kl_coef = 0.001``, ``target_kl = 0.1``,
  ``horizon = 10000``.
- ``clip = 0.2`` [PAPER] Ziegler et al. clip the proportional error to ±0.2; [CODE] both libraries.
- ``estimator = "k1"`` [CODE] TRL ``kl_penalty = "kl"``, verl ``algorithm.kl_penalty = "kl"``.
- ``level = "sequence"`` [CODE] TRL's ``objective/kl`` (Σ over the completion, mean over rows),
  the scale of ``target = 6`` nats; ``"token_mean"`` is verl's ``current_kl``.
- ``n_steps = 0`` → the number of valid rows of the batch [CODE] TRL passes ``batch_size ·
  num_processes``, verl ``batch_size``: the sequences of one PPO step.

**Notes**

1. Timing: the trainer calls the controller once per step after the whole batch is scored, so the
   returned value is the one after this step's update. A reward owner (``kl_penalty``) scored this
   step with the previous value and uses the new one from the next step — verl's and TRL's order
   (reward with β_t, then update to β_t+1). An objective owner uses it in this step's loss.
2. It reads ``rollout.logp_old`` and ``rollout.logp_ref``, filled for the whole batch when the
   owner declares ``Need("logp")`` and ``Need("logp", model="ref")`` (``kl_penalty`` does; the
   objective term ``kl`` declares only the reference); without them it raises. The controller
   also lists both in ``needs`` for a trainer that collects schedules' needs.
3. Rows are the valid rows (``group_valid``); a valid row without tokens counts with KL 0, as in
   both libraries. A batch without valid rows leaves the value unchanged.
4. ``state_dict`` holds the value, so a resumed run continues exactly; ``start()`` is ``init`` before
   any step, else the last value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from groupwise.kl_estimators import token_kl
from groupwise.registry import build, register
from groupwise.schedules import refuse_changed_start
from groupwise.types import Need, Rollout, StepInfo

LEVELS = ("sequence", "token_mean")


def observed_kl(rollout: Rollout, estimator: Any, level: str = "sequence") -> tuple[float, int] | None:
    """(mean over valid rows of the row KL, #valid rows) from ``logp_old`` vs ``logp_ref``; None if no row."""
    if rollout.logp_old is None or rollout.logp_ref is None:
        raise ValueError(
            "adaptive_kl needs rollout.logp_old and rollout.logp_ref: the owner of the scheduled coefficient "
            "must declare Need('logp') and Need('logp', model='ref') (kl_penalty does)"
        )
    mask = rollout.row_mask.bool()  # [B,G,T]
    valid = rollout.group_valid.bool()  # [B,G]
    n = int(valid.sum())
    if n == 0:
        return None
    with torch.no_grad():
        kl = token_kl(estimator, rollout.logp_old, rollout.logp_ref, mask).double()  # [B,G,T]
        row = kl.sum(-1)  # [B,G]
        if level == "token_mean":
            row = row / mask.sum(-1).clamp(min=1)  # [B,G]
        return float(row[valid].mean()), n


@register("schedule", "adaptive_kl")
@dataclass
class AdaptiveKL:
    """KL coefficient ← value·(1 + clip(KL/target − 1, ±0.2)·n/horizon) (PPO-RLHF, Ziegler et al. 2019)."""

    init: float = 0.2
    target: float = 6.0
    horizon: float = 10000.0
    clip: float = 0.2
    estimator: str = "k1"
    level: str = "sequence"
    n_steps: int = 0

    needs = (Need("logp"), Need("logp", model="ref"))

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"adaptive_kl: level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if not (self.target > 0 and self.horizon > 0 and self.clip >= 0 and self.init >= 0 and self.n_steps >= 0):
            raise ValueError(
                f"adaptive_kl: need target > 0, horizon > 0, clip >= 0, init >= 0, n_steps >= 0; got {self}"
            )
        self._kl = build("kl", self.estimator)
        self._value = float(self.init)
        self.last_kl: float | None = None

    def _update(self, kl: float, n_steps: int) -> float:
        """One controller step from an observed KL over ``n_steps`` samples; returns the new value."""
        error = min(max(kl / self.target - 1.0, -self.clip), self.clip)
        self._value *= 1.0 + error * n_steps / self.horizon
        return self._value

    def start(self) -> float:
        return self._value

    def __call__(self, info: StepInfo, rollout: Rollout) -> float:
        seen = observed_kl(rollout, self._kl, self.level)
        if seen is None:
            return self._value
        self.last_kl, rows = seen
        return self._update(self.last_kl, self.n_steps or rows)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self._value, "last_kl": self.last_kl, "init": self.init}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        refuse_changed_start("adaptive_kl", state, init=self.init)
        self._value, self.last_kl = float(state["value"]), state["last_kl"]
