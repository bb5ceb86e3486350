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
are checkpointed with the other components, by name (``<component>.<attribute>``). On resume every
parameter of a schedule takes effect from the resumed step on, except those that only set a
controller's value before its first step (``init``): the controller continues from its checkpointed
value, so a changed ``init`` is refused (:func:`refuse_changed_start`).

Protocol (structural)::

    start() -> float                               # the value before any step
    __call__(info: StepInfo, rollout: Rollout) -> float   # once per step, on the whole batch
"""

from __future__ import annotations

from typing import Any

from groupwise.types import Rollout, StepInfo


def refuse_changed_start(owner: str, state: dict[str, Any], **configured: Any) -> None:
    """A stateful controller resumes from its checkpointed value: the parameters that only set its
    value before the first step (``init``) cannot take effect on resume, so a change is refused,
    naming them (a state saved without them is not checked)."""
    changed = {k: (state[k], v) for k, v in configured.items() if k in state and state[k] != v}
    if changed:
        from groupwise.errors import ConfigError

        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
        raise ConfigError(
            f"{owner}: {shown} is not changeable on resume (it sets the value before the first step; "
            f"the run continues from the checkpointed value {state.get('value')!r}); rerun with the "
            f"stored value, or train into a new folder with out=..."
        )


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
