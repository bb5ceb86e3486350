"""Step schedules for any coefficient: constant, linear, cosine, and warm-up-then-constant.

Standard practice (no single paper): the linear and cosine shapes are the learning-rate schedules
of ``torch.optim.lr_scheduler`` applied to an arbitrary coefficient, e.g. a KL coefficient that
decays, or an auxiliary loss switched on gradually.

**Change vs GRPO**: none by default; GRPO's coefficients are constants.

**Math** (``s`` = ``info.step``, ``S`` = ``steps`` or, when 0, ``info.total_steps``;
``u = min(s / max(S, 1), 1)``)::

    constant:  value
    linear:    start_value + (end - start_value) * u
    cosine:    end + (start_value - end) * (1 + cos(pi * u)) / 2
    warmup:    value * min(1, (s + 1) / warmup_steps)

**Defaults** (all [INFERRED]: no paper prescribes them; each names the obvious shape)

- ``steps = 0`` (the phase's length) [INFERRED] a schedule spans the run unless told.
- constant: ``value = 0.0`` [INFERRED].
- linear: ``start_value = 0.0``, ``end = 1.0`` [INFERRED] a ramp up.
- cosine: ``start_value = 1.0``, ``end = 0.0`` [INFERRED] a decay, like ``CosineAnnealingLR``.
- warmup: ``value = 1.0``, ``warmup_steps = 1`` [INFERRED] (1: full value from step 0).

**Notes**

1. Values are read once per step (``schedules.resolve``); they never depend on the batch.
2. ``start()`` is the value at step 0, used to construct the component before training starts.
3. ``info.total_steps`` is ``train.steps``. When both it and ``steps`` are 0 (unknown length),
   ``S`` counts as 1, so linear and cosine reach ``end`` at step 1. Past ``S`` the value stays at
   ``end``.
4. ``warmup`` reaches ``value`` at step ``warmup_steps - 1``. ``steps < 0`` or
   ``warmup_steps < 1`` is a ``ValueError`` at build time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def _progress(step: int, steps: int, total: int) -> float:
    span = steps or total
    return min(step / max(span, 1), 1.0)


@register("schedule", "constant")
@dataclass
class ConstantSchedule:
    """A constant coefficient (the same as a plain number; useful in sweeps)."""

    value: float = 0.0

    def start(self) -> float:
        return self.value

    def __call__(self, info: StepInfo, rollout: Rollout | None = None) -> float:
        return self.value


@register("schedule", "linear")
@dataclass
class LinearSchedule:
    """Linear ramp from ``start_value`` to ``end`` over ``steps`` (default: the whole run)."""

    start_value: float = 0.0
    end: float = 1.0
    steps: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"linear schedule: steps must be >= 0, got {self.steps}")

    def start(self) -> float:
        return self.start_value

    def __call__(self, info: StepInfo, rollout: Rollout | None = None) -> float:
        u = _progress(info.step, self.steps, info.total_steps)
        return self.start_value + (self.end - self.start_value) * u


@register("schedule", "cosine")
@dataclass
class CosineSchedule:
    """Half-cosine from ``start_value`` to ``end`` over ``steps`` (default: the whole run)."""

    start_value: float = 1.0
    end: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"cosine schedule: steps must be >= 0, got {self.steps}")

    def start(self) -> float:
        return self.start_value

    def __call__(self, info: StepInfo, rollout: Rollout | None = None) -> float:
        u = _progress(info.step, self.steps, info.total_steps)
        return self.end + (self.start_value - self.end) * (1.0 + math.cos(math.pi * u)) / 2.0


@register("schedule", "warmup")
@dataclass
class WarmupSchedule:
    """``value`` reached linearly over the first ``warmup_steps`` steps, then constant."""

    value: float = 1.0
    warmup_steps: int = 1

    def __post_init__(self) -> None:
        if self.warmup_steps < 1:
            raise ValueError(f"warmup schedule: warmup_steps must be >= 1, got {self.warmup_steps}")

    def start(self) -> float:
        return self.value / self.warmup_steps

    def __call__(self, info: StepInfo, rollout: Rollout | None = None) -> float:
        return self.value * min(1.0, (info.step + 1) / self.warmup_steps)
