"""Step schedules for any coefficient: constant, linear, cosine, polynomial, step, warm-up-then-constant,
and piecewise-constant phases.

Standard practice (no single paper): the linear, cosine and polynomial shapes are the learning-rate
schedules of ``torch.optim.lr_scheduler`` (``LinearLR``, ``CosineAnnealingLR``, ``PolynomialLR``)
applied to an arbitrary coefficient, e.g. a KL coefficient that decays, an auxiliary loss switched
on gradually, HölderPO's annealed order p (specs/30) or ConSPO's curriculum margin (specs/25).

**Change vs GRPO**: none by default; GRPO's coefficients are constants.

**Math** (``s`` = ``info.step``, ``S`` = ``steps`` or, when 0, ``info.total_steps``;
``u = min(s / max(S, 1), 1)``)::

    constant:  value
    linear:    start_value + (end - start_value) * u
    cosine:    end + (start_value - end) * (1 + cos(pi * u)) / 2
    polynomial: start_value + (end - start_value) * f(u)
               f(u) = u ** power                                     (centered = false)
               f(u) = (1 + sgn(2u - 1) * |2u - 1| ** power) / 2      (centered = true)
    step:      start_value while u < 1, then end
    warmup:    value * min(1, (s + 1) / warmup_steps)
    piecewise: values[k],  k = #{a in at : u >= a}                  (at: increasing fractions of the span)

**Defaults** (all [INFERRED]: no paper prescribes them; each names the obvious shape)

- ``steps = 0`` (the phase's length) [INFERRED] a schedule spans the run unless told.
- constant: ``value = 0.0`` [INFERRED].
- linear: ``start_value = 0.0``, ``end = 1.0`` [INFERRED] a ramp up.
- cosine: ``start_value = 1.0``, ``end = 0.0`` [INFERRED] a decay, like ``CosineAnnealingLR``.
- polynomial: ``start_value = 0.0``, ``end = 1.0``, ``power = 2.0``, ``centered = false``
  [INFERRED] a quadratic ramp up; ``centered = true`` with ``power = 3`` is HölderPO's ``cubic``
  shape, mid + amp·(2u − 1)³ (specs/30 [CODE]).
- step: ``start_value = 0.0``, ``end = 1.0`` [INFERRED] a switch at the end of the span.
- warmup: ``value = 1.0``, ``warmup_steps = 1`` [INFERRED] (1: full value from step 0).
- piecewise: ``values = [0.0]``, ``at = []`` [INFERRED] one phase; HT-GRPO's three training stages
  (spec 12) are ``values = [0, 1, 2], at = [0.4, 0.7]``.

**Notes**

1. Values are read once per step (``schedules.resolve``); they never depend on the batch.
2. ``start()`` is the value at step 0, used to construct the component before training starts.
3. ``info.total_steps`` is ``train.steps``. When both it and ``steps`` are 0 (unknown length),
   ``S`` counts as 1, so linear and cosine reach ``end`` at step 1. Past ``S`` the value stays at
   ``end``.
4. ``warmup`` reaches ``value`` at step ``warmup_steps - 1``. ``steps < 0``,
   ``warmup_steps < 1`` or ``power <= 0`` is a ``ValueError`` at build time.
5. ``polynomial`` with ``power = 1`` is ``linear``; centred, f(1/2) = 1/2 (the midpoint is reached
   half-way whatever the power) and f is odd-symmetric about it: f(u) + f(1 − u) = 1.
6. ``step`` jumps exactly at step ``S`` (u = 1). With ``steps = 0`` that is step ``train.steps``,
   one past the last: the run stays at ``start_value`` (give ``steps`` for a switch).
7. ``piecewise`` needs ``len(values) == len(at) + 1`` and ``at`` strictly increasing in (0, 1]; a
   boundary belongs to the later phase (u = 0.4 with ``at = [0.4]`` is ``values[1]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


@dataclass
class _Span:
    """The shared part of the schedules that go from ``start_value`` to ``end`` over ``steps``."""

    start_value: float = 0.0
    end: float = 1.0
    steps: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"{self.registry_name} schedule: steps must be >= 0 (0 = the whole run), got {self.steps}")

    def start(self) -> float:
        return self.start_value  # every shape starts at u = 0 on start_value

    def _u(self, info: StepInfo) -> float:
        return _progress(info.step, self.steps, info.total_steps)


@register("schedule", "linear")
@dataclass
class LinearSchedule(_Span):
    """Linear ramp from ``start_value`` to ``end`` over ``steps`` (default: the whole run)."""

    def __call__(self, info: StepInfo, rollout: Rollout | None = None) -> float:
        return self.start_value + (self.end - self.start_value) * self._u(info)


@register("schedule", "cosine")
@dataclass
class CosineSchedule(_Span):
    """Half-cosine from ``start_value`` to ``end`` over ``steps`` (default: the whole run)."""

    start_value: float = 1.0
    end: float = 0.0

    def __call__(self, info: StepInfo, rollout: Rollout | None = None) -> float:
        return self.end + (self.start_value - self.end) * (1.0 + math.cos(math.pi * self._u(info))) / 2.0


@register("schedule", "polynomial")
@dataclass
class PolynomialSchedule(_Span):
    """Polynomial ramp ``start_value → end`` in ``u ** power`` (or centred, odd about the midpoint) over ``steps``."""

    power: float = 2.0
    centered: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.power > 0:
            raise ValueError(f"polynomial schedule: power must be > 0 (1 = linear), got {self.power}")

    def __call__(self, info: StepInfo, rollout: Rollout | None = None) -> float:
        u = self._u(info)
        if self.centered:
            x = 2.0 * u - 1.0
            f = (1.0 + math.copysign(abs(x) ** self.power, x)) / 2.0
        else:
            f = u**self.power
        return self.start_value + (self.end - self.start_value) * f


@register("schedule", "step")
@dataclass
class StepSchedule(_Span):
    """``start_value`` until ``steps`` (default: the whole run), then ``end``."""

    def __call__(self, info: StepInfo, rollout: Rollout | None = None) -> float:
        return self.end if self._u(info) >= 1.0 else self.start_value


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


@register("schedule", "piecewise")
@dataclass
class PiecewiseSchedule:
    """``values[k]`` in the k-th phase of the span, phases starting at the fractions ``at`` (Note 7)."""

    values: list[float] = field(default_factory=lambda: [0.0])  # one value per phase
    at: list[float] = field(default_factory=list)  # the fractions of the span where phases 2, 3, ... start
    steps: int = 0  # the span (0 = the whole run)

    def __post_init__(self) -> None:
        edges = [0.0, *self.at]
        if len(self.values) != len(self.at) + 1 or any(b <= a for a, b in zip(edges, edges[1:])) or edges[-1] > 1:
            raise ValueError(
                f"piecewise schedule: need len(values) == len(at) + 1 and at strictly increasing in (0, 1]; "
                f"got values={self.values}, at={self.at}"
            )
        if self.steps < 0:
            raise ValueError(f"piecewise schedule: steps must be >= 0 (0 = the whole run), got {self.steps}")

    def start(self) -> float:
        return float(self.values[0])

    def __call__(self, info: StepInfo, rollout: Rollout | None = None) -> float:
        u = _progress(info.step, self.steps, info.total_steps)
        return float(self.values[sum(u >= a for a in self.at)])
