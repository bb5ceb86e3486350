"""Coefficients that change during a run: schedules of the step and controllers of batch statistics.

Any numeric hyper-parameter of any component may be given as a table with a ``schedule`` key
instead of a number::

    objective.terms = [{ name = "kl", coef = { schedule = "linear", start_value = 0.0, end = 0.04 } }]
    objective.terms = [{ name = "kl", coef = { schedule = "akl", beta_max = 0.08 } }]

``registry.build`` builds the schedule (stage ``schedule``), constructs the component with the
schedule's :meth:`start` value, and records it in the component's ``schedules`` dict. Once per
step, after the step's whole batch is scored and before advantages are estimated, the trainer calls
:func:`resolve`, which sets each scheduled attribute to ``schedule(info, rollout)``; the component
itself only ever sees a plain number. Controllers that keep state (an EMA) have ``state_dict`` and
are checkpointed with the other components.

Protocol (structural)::

    start() -> float                               # the value before any step
    __call__(info: StepInfo, rollout: Rollout) -> float   # once per step, on the whole batch
"""

from __future__ import annotations

from typing import Any

from groupwise.types import Rollout, StepInfo


def scheduled(component: Any) -> dict[str, Any]:
    """``{attribute: schedule}`` of a component built with scheduled parameters."""
    return getattr(component, "schedules", None) or {}


def resolve(components: list[Any], info: StepInfo, rollout: Rollout) -> dict[str, float]:
    """Set every scheduled attribute for this step; returns ``{"coef/<owner>.<attr>": value}`` to log."""
    values: dict[str, float] = {}
    for component in components:
        for attr, schedule in scheduled(component).items():
            value = float(schedule(info, rollout))
            setattr(component, attr, value)
            owner = getattr(component, "registry_name", type(component).__name__)
            values[f"coef/{owner}.{attr}"] = value
    return values


def all_schedules(components: list[Any]) -> list[Any]:
    """Every schedule object held by the components (for checkpointing), in a stable order."""
    return [schedule for component in components for _, schedule in sorted(scheduled(component).items())]
