"""Target-entropy controller: a coefficient that rises while the batch entropy is below a target.

Additive form: Skywork-OR1's adaptive entropy control, "Skywork Open Reasoner 1 Technical Report",
Jujie He, Jiacai Liu, Chris Yuhao Liu et al., 2025, https://arxiv.org/abs/2505.22312 — code
SkyworkAI/Skywork-OR1 ``verl/trainer/ppo/core_algos.py`` ``EntController`` (driven from
``ray_trainer.py``, applied in ``dp_actor.py``). Multiplicative form: the automatic temperature of
"Soft Actor-Critic Algorithms and Applications", Tuomas Haarnoja et al., 2018,
https://arxiv.org/abs/1812.05905 (§5, eq. 18), stepped in log space.

**Change vs GRPO**: GRPO has no entropy term; with ``entropy_bonus`` this controller keeps the policy's
entropy near ``target`` instead of letting it collapse. Any coefficient may use it::

    objective.terms = ["ppo_clip", { name = "entropy_bonus", coef = { schedule = "target_entropy", target = 0.2 } }]

**Math** (``H`` = mean of ``rollout.extras["entropy"]`` over the step's valid completion tokens)::

    additive:        value ← value + delta   if H < target,   value − delta   otherwise
    multiplicative:  value ← value · exp(lr · (target − H))
    value ← clip(value, coef_min, coef_max)
    coef  = value · [H < target]   (gate = True)      coef = value   (gate = False)

**Defaults**

- ``mode = "additive"``, ``target = 0.2``, ``delta = 1e-4``, ``init = 0.0``, ``coef_min = 0.0``,
  ``coef_max = 0.005``, ``gate = True`` [CODE] Skywork-OR1 ``or1_scripts/train/*.sh``
  (``TGT_ENTROPY``, ``DELTA_ENT_COEF``, ``ENTROPY_COEFF``, ``MIN_ENT_COEF``, ``MAX_ENT_COEF``) and
  ``EntController.entropy_loss_enabled``.
- ``lr = 1.0`` [INFERRED] the multiplicative step: a 0.1-nat gap moves the value by about 10 % per step;
  the log-space step is SAC's gradient step on log α [PAPER form, step size INFERRED].

**Notes**

1. Timing: the trainer calls the schedule once per step on the whole scored batch, before advantages,
   so the coefficient of step k follows the entropy of step k's batch (under the sampling weights).
   Skywork-OR1 updates after step k from the entropy logged during its update and applies it at step
   k + 1: the same rule, one step less lag here.
2. ``H`` is a token mean over the whole batch; Skywork logs the mean over micro-batches of each
   micro-batch's ``loss_agg_mode`` mean (equal for equal-sized token-mean micro-batches).
3. The owner of the scheduled coefficient must declare a no-grad ``Need("entropy")`` (``entropy_bonus``
   does); without ``rollout.extras["entropy"]`` the schedule raises. A batch without valid tokens leaves
   everything unchanged.
4. ``multiplicative`` needs ``init > 0`` (0 would stay 0). ``state_dict`` holds the value and the last
   coefficient, so a resumed run continues exactly; ``start()`` is ``init`` before any step (Skywork's
   gate starts open), else the last coefficient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from groupwise.registry import register
from groupwise.schedules import refuse_changed_start
from groupwise.types import Rollout, StepInfo

MODES = ("additive", "multiplicative")


def batch_entropy(rollout: Rollout) -> float | None:
    """Mean of ``extras["entropy"]`` over valid completion tokens; None when there are none."""
    if "entropy" not in rollout.extras:
        raise ValueError(
            "target_entropy needs rollout.extras['entropy']: the scheduled component must declare a "
            "no-grad Need('entropy') (entropy_bonus does)"
        )
    H = rollout.extras["entropy"].double()  # [B,G,T]
    ok = rollout.row_mask.bool() & torch.isfinite(H)  # [B,G,T]
    return float(H[ok].mean()) if bool(ok.any()) else None


@register("schedule", "target_entropy")
@dataclass
class TargetEntropySchedule:
    """Coefficient rises while batch entropy < target, falls above it (Skywork-OR1 adaptive entropy control)."""

    target: float = 0.2
    mode: str = "additive"
    init: float = 0.0
    delta: float = 1e-4
    lr: float = 1.0
    coef_min: float = 0.0
    coef_max: float = 0.005
    gate: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"target_entropy: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.coef_min <= self.init <= self.coef_max:
            raise ValueError(
                f"target_entropy: need coef_min <= init <= coef_max, got {self.coef_min}, {self.init}, {self.coef_max}"
            )
        if self.mode == "multiplicative" and not self.init > 0:
            raise ValueError(f"target_entropy: multiplicative mode needs init > 0 (0 stays 0), got {self.init}")
        if self.delta < 0 or self.lr < 0:
            raise ValueError(f"target_entropy: delta and lr must be >= 0, got {self.delta}, {self.lr}")
        self._value = float(self.init)
        self._coef: float | None = None

    def start(self) -> float:
        return self._coef if self._coef is not None else self._value

    def __call__(self, info: StepInfo, rollout: Rollout) -> float:
        H = batch_entropy(rollout)
        if H is None:
            return self.start()
        below = H < self.target
        if self.mode == "additive":
            value = self._value + (self.delta if below else -self.delta)
        else:
            value = self._value * math.exp(self.lr * (self.target - H))
        self._value = min(max(value, self.coef_min), self.coef_max)
        self._coef = self._value if (below or not self.gate) else 0.0
        return self._coef

    def state_dict(self) -> dict[str, Any]:
        return {"value": self._value, "coef": self._coef, "init": self.init}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        refuse_changed_start("target_entropy", state, init=self.init)
        self._value, self._coef = state["value"], state["coef"]
