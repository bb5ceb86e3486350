"""Calling one reward function: its failures become errors naming it, an exit stops the run, and
``timeout_s`` cuts a call that hangs (on the main thread by a timer signal, elsewhere by abandoning a
daemon thread). See ``rewards/score.py`` for the contract."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from groupwise.errors import ConfigError
from groupwise.rewards._common import RewardError


class RewardAborted(RuntimeError):
    """A reward function raised SystemExit or KeyboardInterrupt: the run stops (never excluded).
    Deliberately not a RewardError, so ``on_error="exclude"`` cannot swallow it."""

    @classmethod
    def of(cls, label: str, err: BaseException) -> RewardAborted:
        what = f"SystemExit({err.code!r})" if isinstance(err, SystemExit) else type(err).__name__
        return cls(
            f"reward {label!r} raised {what}; a reward function must return its values, not exit "
            f"or interrupt the process. The run is stopped (on_error cannot exclude this)"
        )


def call(fn: Callable[..., Any], label: str, prompts, completions, columns, timeout_s: float | None) -> Any:
    """Call one reward function; any failure becomes a RewardError naming it."""
    if timeout_s is not None and threading.current_thread() is not threading.main_thread():
        return _call_in_thread(fn, label, prompts, completions, columns, timeout_s)
    try:
        with _deadline(timeout_s):
            return fn(prompts=prompts, completions=completions, **columns)
    except _Deadline:
        raise RewardError(
            f"reward {label!r} did not return within timeout_s={timeout_s} s (interrupted; reward.timeout_s)"
        ) from TimeoutError(f"no result after {timeout_s} s")
    except ConfigError:  # the recipe names something that does not exist (an env): not a failed sample
        raise
    except Exception as err:
        raise RewardError(f"reward {label!r} raised {type(err).__name__}: {err}") from err
    except (SystemExit, KeyboardInterrupt) as err:
        raise RewardAborted.of(label, err) from err


class _Deadline(BaseException):
    """Raised into the main thread when a reward call's time is up (BaseException: a reward's own
    ``except Exception`` does not swallow it)."""


_DEADLINE_SIGNAL = signal.SIGUSR2
_HARD_EXIT_GRACE_S = 30.0


@contextlib.contextmanager
def _deadline(timeout_s: float | None):
    """Interrupt the main thread after ``timeout_s``: a timer thread sends it ``SIGUSR2``, whose
    handler raises :class:`_Deadline` wherever the reward is (a ``sleep``, a ``wait``, a Python
    loop). The reward keeps the main thread, so libraries that need it (math-verify's
    ``signal.alarm``) work. Code stuck in C that never returns to Python cannot be interrupted:
    after a further grace period the process exits (status 3) with a message; the run then resumes
    from its last checkpoint."""
    if not timeout_s:
        yield
        return
    armed = [True]
    main = threading.get_ident()

    def on_signal(signum: int, frame: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise _Deadline()

    def fire() -> None:
        if armed[0]:
            signal.pthread_kill(main, _DEADLINE_SIGNAL)
            if not done.wait(_HARD_EXIT_GRACE_S):
                print(
                    f"groupwise: a reward call did not return {timeout_s + _HARD_EXIT_GRACE_S:.0f} "
                    "s after it started and cannot be interrupted (stuck outside Python); exiting "
                    "so the run can resume from its last checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)

    done = threading.Event()
    previous = signal.signal(_DEADLINE_SIGNAL, on_signal)
    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        armed[0] = False
        done.set()
        timer.cancel()
        signal.signal(_DEADLINE_SIGNAL, previous)


def _call_in_thread(fn: Callable[..., Any], label: str, prompts, completions, columns, timeout_s: float) -> Any:
    """Off the main thread no signal can reach the call: run it in a daemon thread, abandon it at the deadline."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(prompts=prompts, completions=completions, **columns)
        except BaseException as err:  # handed to the caller's thread below
            box["error"] = err

    thread = threading.Thread(target=target, name=f"reward:{label}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        err = TimeoutError(f"no result after {timeout_s} s")
        raise RewardError(
            f"reward {label!r} did not return within timeout_s={timeout_s} s (its thread is abandoned)"
        ) from err
    if "error" in box:
        err = box["error"]
        if isinstance(err, (SystemExit, KeyboardInterrupt)):
            raise RewardAborted.of(label, err) from err
        if not isinstance(err, Exception) or isinstance(err, ConfigError):
            raise err
        raise RewardError(f"reward {label!r} raised {type(err).__name__}: {err}") from err
    return box["value"]
