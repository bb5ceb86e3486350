"""The math-verify worker process behind the ``math`` reward (see ``math.py``).

Started by ``math.py`` as a script, ``_math_worker.py <fd> <parent pid>``, without importing the
``groupwise`` package (this file needs only the standard library and math-verify): ``fd`` is the
child end of a socket pair, wrapped as a ``multiprocessing.connection.Connection``. Protocol:

    worker -> parent   ("ready", pid)                 once, after importing and warming up
    parent -> worker   [(i, gold, completion), ...]   a batch; ``gold`` is the extracted answer
    worker -> parent   (i, 1.0 | 0.0 | None)          one message per item, in order
    parent -> worker   None                           exit

math-verify's own ``signal.alarm`` timeouts are switched off: the parent enforces a wall-clock
limit per item and kills this process when it is exceeded (an alarm cannot interrupt C code that
never returns to the interpreter, and math-verify scores its own timeouts 0.0, not "no verdict").
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from multiprocessing.connection import Connection


@functools.lru_cache(maxsize=4096)
def parse_gold(gold: str) -> tuple:
    """Parse an extracted gold answer (LaTeX or plain) as if it were boxed; () if unparseable."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    return tuple(parse("\\boxed{" + gold + "}", extraction_config=configs, parsing_timeout=None))


def judge(gold: str, completion: str) -> float | None:
    """1.0 if ``completion``'s final answer equals ``gold``, 0.0 if not, None if ``gold`` does not parse.

    No timeout: run it only where a hang is acceptable, or in this worker."""
    from math_verify import parse, verify

    gold_parsed = parse_gold(gold)
    if not gold_parsed:
        return None
    answer = parse(completion, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if verify(list(gold_parsed), answer, timeout_seconds=None) else 0.0


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the parent dies (works even inside C code)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except Exception:  # pragma: no cover - best effort
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def main(fd: int, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout is disabled" warnings
    conn = Connection(fd)
    judge("1", "$1$")  # import sympy / the LaTeX parser now, not inside the first timed item
    conn.send(("ready", os.getpid()))
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        for i, gold, completion in batch:
            try:
                value = judge(gold, completion)
            except Exception:
                value = None
            conn.send((i, value))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
