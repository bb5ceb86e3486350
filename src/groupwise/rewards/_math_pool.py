"""Persistent math-verify worker processes with a hard wall-clock limit per item (used by ``math.py``).

``MathVerifierPool(timeout_s, num_workers).verify([(gold, completion), ...])`` sends each worker
one contiguous chunk of the batch in a single message and reads one result per item back. Each
item gets ``timeout_s`` seconds from the moment its predecessor's result arrived (or the batch was
sent); when that passes, the worker is killed (SIGKILL: it may be stuck in C code), the item scores
``None``, a fresh worker is started without waiting for it, and the rest of the chunk is resent
once it is ready. Start-up time (importing SymPy, ~1 s) never counts against an item.

Workers are fresh interpreters running ``_math_worker.py`` directly — like multiprocessing's
"spawn" but without spawn's re-import of the caller's ``__main__`` (which would re-run an
unguarded training script in the worker) and without importing ``groupwise`` (torch). This module
needs only the standard library.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait

STARTUP_TIMEOUT_S = 120.0  # a cold worker imports SymPy; on a loaded machine this can take a while
_WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_worker.py")
# run the worker file as __main__ with the script's directory NOT on sys.path (this package holds a
# ``math.py`` that would shadow the standard library's ``math``)
_BOOT = "import sys, runpy; del sys.path[0]; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def _terminate(proc: subprocess.Popen, conn: Connection) -> None:
    try:
        proc.kill()
        proc.wait(timeout=10)
    except Exception:
        pass
    try:
        conn.close()
    except Exception:
        pass


class _Worker:
    """One ``_math_worker`` process and the queue of item indices it still owes a result for."""

    def __init__(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # like multiprocessing's spawn: the child sees the parent's sys.path (math_verify wherever
        # the parent found it)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, _WORKER_FILE, str(child_sock.fileno()), str(os.getpid())],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.ready = False
        self.sent = False  # whether ``queue`` has been sent to this process
        self.queue: deque[int] = deque()
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S
        self._finalizer = weakref.finalize(self, _terminate, self.proc, self.conn)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self._finalizer()


class MathVerifierPool:
    """Persistent math-verify workers; ``verify(pairs)`` scores ``(gold, completion)`` pairs, each
    within ``timeout_s`` seconds of wall-clock time or ``None``. Thread-safe (one batch at a time)."""

    def __init__(self, timeout_s: float = 5.0, num_workers: int = 1) -> None:
        self.timeout_s = float(timeout_s)
        self.num_workers = int(num_workers)
        self.timeouts = 0  # items scored None because they ran out of time
        self.crashes = 0  # items scored None because the worker died on them
        self.restarts = 0
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the workers and wait until they are ready (optional: ``verify`` starts them)."""
        with self._lock:
            self._ensure_workers()
            for w in self._workers:
                self._await_ready(w)

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                try:
                    w.conn.send(None)
                except Exception:
                    pass
                w.kill()
            self._workers = []

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def verify(self, pairs: Sequence[tuple[str, str]]) -> list[float | None]:
        results: list[float | None] = [None] * len(pairs)
        if not pairs:
            return results
        with self._lock:
            self._ensure_workers()
            chunk = -(-len(pairs) // len(self._workers))
            for k, w in enumerate(self._workers):
                w.queue = deque(range(k * chunk, min((k + 1) * chunk, len(pairs))))
                w.sent = False
            self._run(pairs, results)
        return results

    # -- internals (called with the lock held)
    def _ensure_workers(self) -> None:
        self._workers = [w if w.alive() else self._replace(w) for w in self._workers]
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker())

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self.restarts += 1
        fresh = _Worker()
        fresh.queue = w.queue
        return fresh

    def _await_ready(self, w: _Worker) -> None:
        while not w.ready:
            remaining = w.deadline - time.monotonic()
            if remaining <= 0 or not w.conn.poll(remaining):
                w.kill()
                raise RuntimeError(f"math-verify worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
            self._receive(w, None)

    def _receive(self, w: _Worker, results: list[float | None] | None) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            if not w.ready:
                code = w.proc.wait()
                raise RuntimeError(
                    f"math-verify worker exited during start-up (exit code {code}); its stderr is above"
                ) from None
            self._fail_head(w, crashed=True)
            return
        if message[0] == "ready":
            w.ready = True
            return
        i, value = message
        if results is not None and w.queue and w.queue[0] == i:
            results[i] = value
            w.queue.popleft()
            w.deadline = time.monotonic() + self.timeout_s

    def _fail_head(self, w: _Worker, crashed: bool) -> None:
        """The item at the head of ``w``'s queue timed out or crashed it: score None, restart."""
        w.queue.popleft()  # its result stays None
        if crashed:
            self.crashes += 1
        else:
            self.timeouts += 1
        self._workers[self._workers.index(w)] = self._replace(w)

    def _run(self, pairs: Sequence[tuple[str, str]], results: list[float | None]) -> None:
        while True:
            busy = [w for w in self._workers if w.queue]
            if not busy:
                return
            for w in busy:
                if w.ready and not w.sent:
                    try:
                        w.conn.send([(i, *pairs[i]) for i in w.queue])
                    except OSError:  # died between batches: not the items' fault
                        self._workers[self._workers.index(w)] = self._replace(w)
                        continue
                    w.sent = True
                    w.deadline = time.monotonic() + self.timeout_s
            busy = [w for w in self._workers if w.queue]
            next_deadline = min(w.deadline for w in busy)
            for conn in wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic())):
                w = next(w for w in busy if w.conn is conn)
                self._receive(w, results)
            now = time.monotonic()
            for w in [w for w in self._workers if w.queue]:
                if now >= w.deadline and not w.conn.poll(0):
                    if not w.ready:
                        w.kill()
                        raise RuntimeError(f"math-verify worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
                    self._fail_head(w, crashed=False)
