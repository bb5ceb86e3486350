"""The run folder's own rules: one process at a time (a lock holding its pid), files replaced
atomically (never truncated in place), a resumed run refused when its configuration changed, and
``final/`` published in one step.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any

from groupwise.registry import ConfigError

LOCK = ".lock"


class RunLocked(RuntimeError):
    """Another live process holds the run folder."""


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` by ``data`` so a reader (or a kill) sees either the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock`` for the life of the process that trains the run;
    the kernel drops it when that process dies, however it dies."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(f"run folder {self.path.parent} is in use by another groupwise process (pid {holder}); "
                            f"wait for it or stop it, or train into another folder with out=...") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def config_changes(stored: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (stored value, current value)}`` for every leaf that differs (lists compare whole)."""
    old, new = _flatten(stored), _flatten(current)
    missing = object()
    return {k: (old.get(k, missing), new.get(k, missing)) for k in sorted(old.keys() | new.keys())
            if old.get(k, missing) != new.get(k, missing)}


def check_resume(stored: dict[str, Any], current: dict[str, Any], allowed: list[str]) -> None:
    """Refuse to resume a run under another configuration, naming each changed key, unless every
    change is under a key (or a section prefix) in ``allowed``."""
    changes = config_changes(stored, current)
    refused = {k: v for k, v in changes.items() if not any(k == a or k.startswith(a + ".") for a in allowed)}
    if refused:
        shown = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
        raise ConfigError(f"this run folder was started with another configuration ({shown}); rerun with the stored settings, "
                          f"or allow the change with --resume-allow {','.join(refused)}, or train into a new folder with out=...")


def _show(value: Any) -> str:
    return "(absent)" if type(value) is object else repr(value)


_RENAME_EXCHANGE = 2


def publish_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final`` in one step: a reader sees the old ``final`` or
    the new one, never a half-written folder. An existing ``final`` is swapped out with
    ``renameat2(RENAME_EXCHANGE)`` (Linux) and then removed; elsewhere it is renamed aside first."""
    tmp, final = Path(tmp), Path(final)
    if not final.exists():
        os.rename(tmp, final)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    at_fdcwd = -100
    if renameat2 is not None and renameat2(at_fdcwd, os.fsencode(tmp), at_fdcwd, os.fsencode(final), _RENAME_EXCHANGE) == 0:
        shutil.rmtree(tmp)  # now holds the previous final
        return
    aside = final.with_name(f".{final.name}.old{os.getpid()}")
    os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside)
