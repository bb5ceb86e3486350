"""Async reward functions (``async def``): run concurrently on one event loop in a daemon thread.

TRL's ``GRPOTrainer`` (``trl/trainer/grpo_trainer.py``, ``_calculate_rewards``) detects coroutine
reward functions with ``is_async_callable`` (``trl/trainer/utils.py``), starts an event loop in a
daemon thread, and awaits all of them at once with ``asyncio.gather``. Here the same, with the
contract of ``rewards/score.py`` (points 3–4) kept:

1. **One loop per process**, started on first use in a daemon thread named
   ``groupwise-reward-loop`` and reused by every later call (never one loop per step). It is stopped
   at interpreter exit (``atexit``); a forked child starts its own.
2. **Deadline.** With ``timeout_s`` the calls are awaited together for at most ``timeout_s``
   (``asyncio.wait``); an unfinished one is cancelled and becomes the same :class:`RewardError` as a
   sync timeout (``did not return within timeout_s=…``). A coroutine that blocks the loop thread
   with synchronous work cannot be cancelled: the caller stops waiting after a further
   ``_LOOP_GRACE_S``, the blocked loop is told to stop (its thread ends when the coroutine returns)
   and the next call starts a fresh one.
3. **Failures and exits** are caught inside the coroutine, before asyncio sees them (a
   ``SystemExit`` escaping a task would kill the loop thread): an exception becomes a
   :class:`RewardError` naming the function, ``SystemExit`` / ``KeyboardInterrupt`` a
   :class:`RewardAborted`. They are returned, not raised, so the caller settles every function in order.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from groupwise.rewards._call import RewardAborted
from groupwise.rewards._common import RewardError

_LOOP_GRACE_S = 5.0  # beyond timeout_s: how long a loop blocked by synchronous code is waited for
_lock = threading.Lock()
_state: dict[str, Any] = {}  # pid, loop, thread of the running loop


def is_async_callable(fn: Any) -> bool:
    """Calling ``fn`` returns a coroutine: an ``async def`` function, a ``functools.partial`` of one,
    or an object whose ``__call__`` is ``async def`` (as TRL's ``is_async_callable``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or (callable(fn) and inspect.iscoroutinefunction(fn.__call__))


def _loop() -> asyncio.AbstractEventLoop:
    """The process's reward loop, started in a daemon thread on first use."""
    with _lock:
        if _state.get("pid") != os.getpid() or not _state["thread"].is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_serve, args=(loop,), name="groupwise-reward-loop", daemon=True)
            thread.start()
            _state.update(pid=os.getpid(), loop=loop, thread=thread)
        return _state["loop"]


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        for task in asyncio.all_tasks(loop):  # abandoned calls: cancelled, not left pending
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def _retire(loop: asyncio.AbstractEventLoop) -> None:
    """Stop ``loop`` once it runs again; the next call starts a fresh one."""
    with _lock:
        if _state.get("loop") is loop:
            _state.clear()
    loop.call_soon_threadsafe(loop.stop)


@atexit.register
def _shutdown() -> None:
    state = dict(_state)
    if state.get("pid") == os.getpid():
        _retire(state["loop"])
        state["thread"].join(1.0)


def _timed_out(label: str, timeout_s: float, how: str) -> RewardError:
    err = RewardError(f"reward {label!r} did not return within timeout_s={timeout_s} s ({how}; reward.timeout_s)")
    err.__cause__ = TimeoutError(f"no result after {timeout_s} s")
    return err


def call_all(
    calls: list[tuple[Callable[..., Any], str, dict[str, Any]]], prompts, completions, timeout_s: float | None
) -> list[Any]:
    """Await every ``(fn, label, kwargs)`` concurrently; each call's values, or the
    :class:`RewardError` / :class:`RewardAborted` it ended in (returned, in order)."""
    results: list[Any] = [None] * len(calls)
    finished = [False] * len(calls)

    async def one(i: int, fn: Callable[..., Any], label: str, kwargs: dict[str, Any]) -> None:
        try:
            value = fn(prompts=prompts, completions=completions, **kwargs)
            results[i] = await value if inspect.isawaitable(value) else value
        except asyncio.CancelledError:
            raise
        except Exception as err:
            results[i] = RewardError(f"reward {label!r} raised {type(err).__name__}: {err}")
            results[i].__cause__ = err
        except BaseException as err:  # SystemExit, KeyboardInterrupt: caught here, or it would end the loop thread
            results[i] = RewardAborted.of(label, err)
            results[i].__cause__ = err
        finished[i] = True

    async def everyone() -> None:
        tasks = [asyncio.ensure_future(one(i, *call)) for i, call in enumerate(calls)]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:  # abandoned like a sync call's thread; its logging hooks are closed by the caller
            task.cancel()

    loop = _loop()
    future = asyncio.run_coroutine_threadsafe(everyone(), loop)
    try:
        future.result(None if timeout_s is None else timeout_s + _LOOP_GRACE_S)
        how = "its coroutine is cancelled"
    except concurrent.futures.TimeoutError:
        _retire(loop)
        how = "the event loop was blocked by synchronous code in an async reward; the loop is abandoned"
    except BaseException:  # Ctrl-C while waiting: the calls are cancelled, the interrupt goes on
        future.cancel()
        raise
    return [
        results[i] if finished[i] else _timed_out(label, timeout_s or 0.0, how) for i, (_, label, _) in enumerate(calls)
    ]
