"""The keyword arguments TRL hands a reward function besides the columns: ``log_extra``,
``log_metric``, ``completion_ids`` and ``trainer_state``.

TRL's ``GRPOTrainer._calculate_rewards`` (``trl/trainer/grpo_trainer.py``) passes every reward
function ``log_extra(column, values)`` (one value per sample, shown as a column of the completions
table; ``_log_completion_extra``), ``log_metric(name, value)`` (a scalar averaged over the logging
step; ``_log_metric``), ``completion_ids`` (each completion's token ids) and ``trainer_state``
(the ``transformers.TrainerState``; here a :class:`TrainerState` with ``global_step`` only, passed
when the caller knows the step). Here:

1. **Who gets them.** A function whose signature takes ``**kwargs`` (TRL's required form) or names
   the argument; a ``python`` reward answers for its user function (``accepts_kwarg``). Registered
   built-in rewards get none (they would ignore them), unless a class defines ``accepts_kwarg``.
2. **Checked at once.** ``log_extra`` needs a non-empty ``str`` column and one value per completion
   of the call (a list, tuple, or anything with ``.tolist()``); ``log_metric`` a ``str`` name and a
   real number. A violation raises :class:`RewardError` at the call naming the function, the
   column and the expected and got lengths, and is raised again after the function returns, whatever
   ``on_error`` says: like a wrong-length result it is a bug, not a failure to exclude.
3. **Kept only on success.** What a call logs is committed to the :class:`RewardLog` when the call
   returns valid values; a failed, timed-out or excluded call logs nothing. A later ``log_extra``
   for the same column replaces the earlier one. After its call ends a recorder is closed: an
   abandoned call (timed out) that logs later gets a RewardError in its own thread, not our data.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from groupwise.rewards._common import RewardError

HOOKS = ("log_extra", "log_metric", "completion_ids", "trainer_state")


@dataclass(frozen=True)
class TrainerState:
    """The part of TRL's ``trainer_state`` a reward may read: ``global_step``, the optimiser steps done."""

    global_step: int


@dataclass
class RewardLog:
    """What reward functions logged during one scoring call."""

    extra: dict[str, list[Any]] = field(default_factory=dict)  # column -> one value per completion scored
    metrics: dict[str, list[float]] = field(default_factory=dict)  # name -> values, in logging order


def accepts(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (see Note 1)."""
    own = getattr(fn, "accepts_kwarg", None)
    if callable(own):
        return bool(own(name))
    if getattr(type(fn), "registry_name", None) is not None:
        return False  # a built-in reward: unchanged
    return signature_accepts(fn, name)


def signature_accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C function): pass it, as TRL does
        return True
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY) for p in params)


class Recorder:
    """``log_extra`` / ``log_metric`` for one call of one reward function (see the module docstring)."""

    def __init__(self, label: str, n: int):
        self.label, self.n = label, n
        self.extra: dict[str, list[Any]] = {}
        self.metrics: list[tuple[str, float]] = []
        self.error: RewardError | None = None
        self.open = True

    def hooks(self, fn: Any, given: dict[str, Any]) -> dict[str, Any]:
        """The hooks ``fn`` takes: ours, and those in ``given``
        (``completion_ids``, ``trainer_state``) that are not None."""
        given = {"log_extra": self.log_extra, "log_metric": self.log_metric, **given}
        return {k: v for k, v in given.items() if v is not None and accepts(fn, k)}

    def _fail(self, message: str) -> None:
        self.error = self.error or RewardError(f"reward {self.label!r}: {message}")
        raise self.error

    def log_extra(self, column: str, values: Any) -> None:
        if not self.open:
            raise RewardError(
                f"reward {self.label!r} called log_extra after its call ended (timed out); the values are dropped"
            )
        if not isinstance(column, str) or not column:
            self._fail(f"log_extra needs a non-empty column name (str), got {column!r}")
        values = values.tolist() if hasattr(values, "tolist") else values
        if not isinstance(values, (list, tuple)):
            self._fail(
                f"log_extra({column!r}, values) needs a list of {self.n} "
                f"values (one per completion), got a {type(values).__name__}"
            )
        if len(values) != self.n:
            self._fail(
                f"log_extra({column!r}, values) got {len(values)} values for "
                f"{self.n} completions (expected {self.n}, got {len(values)})"
            )
        self.extra[column] = list(values)

    def log_metric(self, name: str, value: float) -> None:
        if not self.open:
            raise RewardError(
                f"reward {self.label!r} called log_metric after its call ended (timed out); the value is dropped"
            )
        if not isinstance(name, str) or not name:
            self._fail(f"log_metric needs a non-empty metric name (str), got {name!r}")
        value = value.item() if hasattr(value, "item") else value
        if not isinstance(value, numbers.Real):
            self._fail(f"log_metric({name!r}, value) needs a real number, got {value!r} ({type(value).__name__})")
        self.metrics.append((name, float(value)))

    def close(self) -> None:
        self.open = False

    def commit(self, log: RewardLog) -> None:
        log.extra.update(self.extra)
        for name, value in self.metrics:
            log.metrics.setdefault(name, []).append(value)
