"""A user reward function with TRL's signature, named by import path or file path.

TRL's ``GRPOTrainer`` (https://huggingface.co/docs/trl/main/en/grpo_trainer#using-a-custom-reward-function)
calls each custom reward function as ``fn(prompts=..., completions=..., **columns)`` and expects a
list with one float (or ``None``) per completion. This component loads such a function so a config
can name it, and calls it unchanged:

    [[rewards]]
    name = "python"
    fn = "my_project.rewards:length_reward"        # importable module
    # fn = "/abs/path/rewards.py:length_reward"   # or a file

**Change vs GRPO**: none — plumbing, no method: the user's function decides the reward, which
GRPO's advantage estimator then centres and scales like any other.

**Math**::

    func   = load_function(fn)          (at build time; ``fn`` may also be a callable, used as is)
    scores = func(prompts=prompts, completions=completions, **columns)     (returned unchanged)

**Defaults**

- ``fn``: required, no default (``None`` is a ``ConfigError``).
- ``weight = 1.0`` [CODE] TRL ``GRPOConfig.reward_weights = None`` weighs every reward 1.0.

**Notes**

1. The function receives ``prompts``, ``completions`` and every column as keyword arguments
   (dataset columns one value per completion, except ``prompt``, which arrives as ``prompts``;
   ``completion_lengths``, ``truncated``, ``max_new_tokens``), so it should accept ``**kwargs`` as
   TRL's do. If it takes ``**kwargs`` (or names them) it also gets TRL's ``completion_ids`` (the
   token ids of each completion), ``log_extra(column, values)`` (one value per completion; in the
   trainer each row's value lands in ``rollout.info[b][g]["extra"][column]`` and in its
   ``samples.jsonl`` row under ``"extra"``) and ``log_metric(name, value)`` (averaged over the step
   and over ranks, logged as ``reward_metric/<name>`` in ``metrics.jsonl``), and ``trainer_state``
   (``global_step`` only) where the caller gives the step to ``RewardStage.score_local(rollout,
   info)``. See ``rewards/_hooks.py``.
2. Its output is validated by :func:`groupwise.rewards.score`, which names it by ``label``: its
   qualified name ``module.qualname``, or for a ``/path/file.py:function`` spec the spec itself.
3. A file is imported under a private module name (``groupwise_user_reward_<stem>_<hash>``, the
   hash from the absolute path) so it cannot shadow an installed module. It is imported once per
   process (kept in ``sys.modules``; removed again if its import fails).
4. The spec is ``where:attr``, split at the last ``:``. ``where`` is a file when it ends in ``.py``
   or contains a path separator, else an importable module. ``attr`` may be dotted
   (``module:Class.method``) and must name a callable. Every failure is a ``ConfigError`` that
   names the spec.
5. ``fn`` may be ``async def`` (or a callable whose ``__call__`` is): the async rewards of a batch
   run concurrently on one event loop in a daemon thread, each within ``reward.timeout_s``
   (``rewards/_async.py``), as TRL runs them with ``asyncio.gather``.
6. On conversational data (each row's ``prompt`` a list of chat messages) the function gets each
   completion as TRL gives it, ``[{"role": "assistant", "content": text}]``, and the prompts as the
   message lists (TRL 1.16 ``GRPOTrainer._generate``, ``trl/trainer/grpo_trainer.py``: ``is_conversational`` of the
   first prompt decides the batch's form; a tokenizer with a ``response_schema`` makes TRL parse
   tool calls into that message too, which groupwise does not). On plain-text prompts, strings.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._async import is_async_callable
from groupwise.rewards._hooks import signature_accepts


def load_function(spec: str) -> Callable[..., Any]:
    """Resolve ``"package.module:function"`` or ``"/path/file.py:function"`` to the callable."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(
            f"reward 'python': fn={spec!r} must look like 'package.module:function' or '/path/file.py:function'"
        )
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ConfigError(
            f"reward 'python': fn={spec!r} must look like 'package.module:function' or '/path/file.py:function'"
        )
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    try:
        module = _import_file(where) if is_file else importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"reward 'python': cannot import {where!r} for fn={spec!r}: {type(err).__name__}: {err}"
        ) from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"reward 'python': {where!r} has no attribute {attr!r} (fn={spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"reward 'python': fn={spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def _import_file(path: str) -> Any:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ConfigError(f"reward 'python': file {path!r} does not exist")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"groupwise_user_reward_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"reward 'python': cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses / pickling inside the user file look themselves up here
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@register("reward", "python")
@dataclass
class Python:
    """A user function ``fn(prompts, completions, **columns) -> list[float | None]`` (TRL's signature)."""

    fn: str | Callable[..., Any] | None = None
    weight: float = 1.0
    _func: Callable[..., Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.fn is None:
            raise ConfigError("reward 'python' needs `fn`, e.g. 'package.module:function' or '/path/file.py:function'")
        self._func = self.fn if callable(self.fn) else load_function(self.fn)

    @property
    def label(self) -> str:
        """The user function's qualified name, used in error messages and counts."""
        if isinstance(self.fn, str) and self.fn.rpartition(":")[0].endswith(".py"):
            return self.fn
        module = getattr(self._func, "__module__", None)
        qualname = getattr(self._func, "__qualname__", None) or type(self._func).__qualname__
        return f"{module}.{qualname}" if module else qualname

    @property
    def is_async(self) -> bool:
        """Whether the user function is a coroutine function (its calls are awaited concurrently)."""
        return is_async_callable(self._func)

    def accepts_kwarg(self, name: str) -> bool:
        """Whether the user function takes keyword ``name`` (``**kwargs`` or by name)."""
        return signature_accepts(self._func, name)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> Any:
        if prompts and is_conversational(prompts[0]):  # TRL's form on chat data: one assistant message each
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        return self._func(prompts=prompts, completions=completions, **columns)


def is_conversational(prompt: Any) -> bool:
    """A prompt given as chat messages (a list of ``{"role", "content"}`` dicts), as TRL's
    ``is_conversational`` tells the batch's form from its first prompt."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]
