"""Run reward functions over a batch, validate what each returns, and combine them.

Follows TRL's ``GRPOTrainer._calculate_rewards``
(https://github.com/huggingface/trl/blob/main/trl/trainer/grpo_trainer.py): every function is
called as ``fn(prompts=..., completions=..., **columns)``, ``None`` becomes NaN, and the total is
``Σ_k weight_k · r_k``. Departures, all toward failing loudly:

1. **Missing verdicts.** TRL sums with ``nansum``, so a ``None`` silently counts as 0. Here, by
   default (``missing="exclude"``), a sample for which ANY function returns ``None``, NaN or ±inf
   is excluded: its ``total`` is NaN, ``excluded`` is True, and it is counted. Downstream stages
   drop excluded rows from group statistics. ``missing="zero"`` opts into TRL's behaviour (no
   verdict counts as 0 in the total; ``parts`` still hold NaN and the count is still kept).
2. **Contract violations are errors naming the function** (its registry name, or for ``python``
   and plain callables the user function's qualified name): a wrong length (expected and got), a
   result that is not a list/tuple, or an element that is not a real number or ``None``. These
   always raise: they are bugs that would otherwise corrupt every step.
3. **Failures.** A function that raises becomes :class:`RewardError` naming it, chained to the
   original exception. With ``timeout_s`` a call that does not return in time is a failure too: on
   the main thread a timer interrupts it there (so math-verify's ``signal.alarm`` still works);
   elsewhere the call runs in a daemon thread that is abandoned. Rewards that may hang in C code
   should isolate themselves in a subprocess, as ``math`` does. With
   ``on_error="exclude"`` a failed function's samples are all excluded and counted instead.
4. **Exits are never failures.** A function that raises ``SystemExit`` (``sys.exit``, any code) or
   ``KeyboardInterrupt`` stops the run with :class:`RewardAborted` naming it, whatever ``on_error``
   and ``timeout_s`` say; otherwise ``sys.exit(0)`` in a reward would end training with status 0.
5. **Overflow.** A weighted total beyond float32's range (3.4e38) is excluded and counted like a
   missing verdict, in both ``missing`` modes: as a float32 reward it would be ±inf.

6. **Async functions** (``async def``, TRL's ``is_async_callable``) run after the sync ones, all
   at once on one persistent event loop in a daemon thread (``rewards/_async.py``), as TRL runs
   them with ``asyncio.gather``; ``timeout_s`` bounds them together, and a timeout, an exception or
   an exit is the same error as for a sync function (points 3–4). A sync function that returns a
   coroutine is awaited there too.
7. **Keyword arguments.** Each function gets ``prompts``, ``completions`` and ``**columns``; one
   that takes ``**kwargs`` (TRL's form; for ``python`` rewards, the user function) also gets TRL's
   ``log_extra(column, values)``, ``log_metric(name, value)`` and, when the caller has them,
   ``completion_ids`` and ``trainer_state`` (a ``TrainerState`` with ``global_step`` only)
   (``rewards/_hooks.py``; built-in rewards get none). What they log comes back in
   ``ScoreResult.extra`` / ``.metrics`` (or the ``log`` given to :func:`score_parts`).

``counts`` has ``"excluded"`` (samples with total NaN, overflowing ones included) and, per function label,
``"<label>/missing"`` (its None/NaN/inf values) and ``"<label>/error"`` (samples lost to its
failure). Two functions with the same label are told apart as ``label``, ``label[1]``, ….
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.rewards._async import call_all as _call_async
from groupwise.rewards._async import is_async_callable
from groupwise.rewards._call import RewardAborted
from groupwise.rewards._call import call as _call
from groupwise.rewards._common import RewardError
from groupwise.rewards._hooks import Recorder, RewardLog

__all__ = [
    "score",
    "score_parts",
    "combine",
    "ScoreResult",
    "RewardError",
    "RewardAborted",
    "RewardLog",
    "reward_label",
]


@dataclass
class ScoreResult:
    total: Tensor  # [N] float32, Σ_k weight_k · r_k; NaN where excluded
    parts: Tensor  # [N,K] float32, r_k per function; NaN where it gave no verdict or failed
    excluded: Tensor  # [N] bool
    counts: dict[str, int]
    extra: dict[str, list[Any]] = field(default_factory=dict)  # log_extra: column -> N values
    metrics: dict[str, list[float]] = field(default_factory=dict)  # log_metric: name -> values logged


def reward_label(fn: Any) -> str:
    """How errors and counts name a reward: ``label`` (python rewards), registry name, or qualname."""
    label = getattr(fn, "label", None)
    if isinstance(label, str) and label:
        return label
    name = getattr(type(fn), "registry_name", None)
    if isinstance(name, str):
        return name
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def score(
    reward_fns: Sequence[Callable[..., Any]],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: dict[str, Any],
    *,
    on_error: str = "raise",
    missing: str = "exclude",
    timeout_s: float | None = None,
    completion_ids: list[list[int]] | None = None,
    trainer_state: Any = None,
) -> ScoreResult:
    """Score ``N`` completions with ``K`` reward functions; see the module docstring."""
    if on_error not in ("raise", "exclude"):
        raise ValueError(f"on_error must be 'raise' or 'exclude', got {on_error!r}")
    if missing not in ("exclude", "zero"):
        raise ValueError(f"missing must be 'exclude' or 'zero', got {missing!r}")
    if not reward_fns:
        raise ValueError("score needs at least one reward function")
    N, _K = len(completions), len(reward_fns)
    if len(prompts) != N:
        raise ValueError(
            f"score got {len(prompts)} prompts for {N} completions; repeat each prompt once per completion"
        )
    for key, values in columns.items():
        if isinstance(values, (list, tuple)) and len(values) != N:
            raise ValueError(f"column {key!r} has {len(values)} values for {N} completions")

    log = RewardLog()
    parts, failed, counts = score_parts(
        reward_fns,
        prompts,
        completions,
        columns,
        on_error=on_error,
        timeout_s=timeout_s,
        completion_ids=completion_ids,
        trainer_state=trainer_state,
        log=log,
    )
    weights = [float(getattr(fn, "weight", 1.0)) for fn in reward_fns]
    total, excluded = combine(parts, weights, failed, missing)
    counts["excluded"] = int(excluded.sum())
    return ScoreResult(
        total=total, parts=parts.float(), excluded=excluded, counts=counts, extra=log.extra, metrics=log.metrics
    )


def score_parts(
    reward_fns,
    prompts,
    completions,
    columns,
    *,
    on_error: str = "raise",
    timeout_s: float | None = None,
    completion_ids: list[list[int]] | None = None,
    trainer_state: Any = None,
    log: RewardLog | None = None,
) -> tuple[Tensor, Tensor, dict[str, int]]:
    """(parts [N,K] float64 with NaN = no verdict, failed [N] bool, counts): each function's own
    values, unweighted; ``failed`` marks samples lost to a function that raised (``on_error="exclude"``).
    What the functions log (point 7) is added to ``log``."""
    N, K = len(completions), len(reward_fns)
    labels = unique_labels([reward_label(fn) for fn in reward_fns])
    log = log if log is not None else RewardLog()
    counts = {"excluded": 0}
    parts = torch.full((N, K), float("nan"), dtype=torch.float64)  # [N,K]
    failed = torch.zeros(N, dtype=torch.bool)  # [N] samples lost to a failed function
    given = {k: v for k, v in (("completion_ids", completion_ids), ("trainer_state", trainer_state)) if v is not None}

    def settle(k: int, label: str, recorder: Recorder, outcome: Any) -> None:
        recorder.close()
        if isinstance(outcome, RewardAborted):
            raise outcome
        if recorder.error is not None:  # a log_extra / log_metric violation, whatever on_error says
            raise recorder.error
        if isinstance(outcome, RewardError):
            if on_error == "raise":
                raise outcome
            failed[:] = True
            counts[f"{label}/error"] = N
            return
        parts[:, k] = torch.tensor(_validate(outcome, label, N), dtype=torch.float64)
        counts[f"{label}/missing"] = int(parts[:, k].isnan().sum())
        recorder.commit(log)

    later = []  # async functions: awaited together after the sync ones (point 6)
    for k, (fn, label) in enumerate(zip(reward_fns, labels)):
        counts[f"{label}/missing"] = 0
        counts[f"{label}/error"] = 0
        recorder = Recorder(label, N)
        kwargs = {**columns, **recorder.hooks(fn, given)}
        if _is_async(fn):
            later.append((k, label, recorder, fn, kwargs))
            continue
        try:
            outcome = _call(fn, label, prompts, completions, kwargs, timeout_s)
        except RewardError as err:
            outcome = err
        except BaseException:  # RewardAborted, or an interrupt of the caller
            recorder.close()
            raise
        if inspect.isawaitable(outcome):  # a sync function that returned a coroutine
            later.append((k, label, recorder, lambda value=outcome, **_: value, kwargs))
            continue
        settle(k, label, recorder, outcome)
    if later:
        outcomes = _call_async(
            [(fn, label, kwargs) for _, label, _, fn, kwargs in later], prompts, completions, timeout_s
        )
        for (k, label, recorder, _, _), outcome in zip(later, outcomes):
            settle(k, label, recorder, outcome)
    return parts, failed, counts


def _is_async(fn: Any) -> bool:
    own = getattr(fn, "is_async", None)  # python rewards answer for their user function
    return own if isinstance(own, bool) else is_async_callable(fn)


def combine(parts: Tensor, weights: list[float], failed: Tensor, missing: str = "exclude") -> tuple[Tensor, Tensor]:
    """The one place reward weights are applied: (total [...] float32 = Σ_k weight_k · parts[..., k],
    NaN where excluded; excluded [...] bool). ``parts`` [..., K] with NaN = no verdict; ``failed``
    [...] samples lost to a failed function; ``missing`` as in :func:`score`."""
    parts = parts.double()  # [...,K]
    w = torch.tensor(weights, dtype=torch.float64)  # [K]
    no_verdict = parts.isnan()  # [...,K]
    total = torch.where(no_verdict, torch.zeros((), dtype=torch.float64), parts * w).sum(dim=-1)  # [...]
    excluded = (failed | no_verdict.any(dim=-1)) if missing == "exclude" else failed.clone()  # [...]
    excluded |= ~torch.isfinite(total.float())  # [...] the float64 sum can pass float32's range (2 × 3e38)
    total = torch.where(excluded, torch.full_like(total, float("nan")), total)  # [...]
    return total.float(), excluded


def unique_labels(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        n = seen.get(label, 0)
        seen[label] = n + 1
        out.append(label if n == 0 else f"{label}[{n}]")
    return out


def _validate(values: Any, label: str, n: int) -> list[float]:
    """One float per completion, NaN for no verdict; a contract violation raises naming ``label``."""
    if not isinstance(values, (list, tuple)):
        raise RewardError(
            f"reward {label!r} returned a {type(values).__name__}; expected "
            f"a list of {n} floats (one per completion, None for no verdict)"
        )
    if len(values) != n:
        raise RewardError(
            f"reward {label!r} returned {len(values)} values for {n} completions (expected {n}, got {len(values)})"
        )
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real):
            x = float(v)
            out.append(x if math.isfinite(x) else math.nan)
        else:
            raise RewardError(
                f"reward {label!r} returned {v!r} ({type(v).__name__}) at index {i}; expected a float or None"
            )
    return out
