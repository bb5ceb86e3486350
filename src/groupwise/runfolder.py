"""The run folder's own rules: one process at a time (a lock holding its pid), files replaced
atomically (never truncated in place), a full disk named with the bytes needed, a resumed run
refused when its configuration changed (or when a key that cannot change on resume changed),
``final/`` published in one step, the ``FINISHED`` marker written after every output, and the
temporary files of a killed run removed when the next one starts.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from groupwise.errors import ConfigError

LOCK = ".lock"
FINISHED = "FINISHED"  # the last file a run writes: the step and each output's size and sha256
_CHUNK = 1 << 20
# what write_atomic (.NAME.tmpPID), publish_dir (.final.oldPID) and checkpoint.save (.tmp_step_N_PID) leave when killed
_TEMPORARY = re.compile(r"^(\..+\.tmp\d+|\.final\.old\d+|\.tmp_step_\d+_\d+)$")


class RunLocked(RuntimeError):
    """Another live process holds the run folder."""


class NoSpace(OSError):
    """The disk cannot hold a write of the run; the message names what, where, the bytes needed and free."""


def no_space(what: str, path: Path, needed: int, cause: OSError | None = None, then: str = "") -> NoSpace:
    """The error for a full disk (``cause``: the failed write's ``ENOSPC`` / ``EDQUOT``, else found
    beforehand): what was being written where, about how many bytes it needs and how many are free."""
    path = Path(path)
    folder = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(folder).free
    code = cause.errno if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT) else errno.ENOSPC
    then = then or "free some space and rerun the same command to resume from the last checkpoint"
    return NoSpace(
        code, f"disk full while writing {what} to {path}: it needs about {needed:,} bytes, {free:,} are free; {then}"
    )


def is_no_space(err: BaseException) -> bool:
    return getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` by ``data`` so a reader (or a kill) sees either the old file or the new one;
    a full disk removes the temporary file and raises :class:`NoSpace` naming the file."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if is_no_space(err):
            raise no_space(
                path.name,
                path,
                len(data),
                err,
                f"the previous {path.name} is untouched; free some space and rerun the same command to resume",
            ) from err
        raise
    os.replace(tmp, path)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_temporary(name: str) -> bool:
    """A name of what a killed write leaves (see :func:`clean_temporary`)."""
    return bool(_TEMPORARY.match(name))


def clean_temporary(run_dir: Path) -> list[Path]:
    """Remove what killed writes left in the run folder (call it holding the lock: no live process
    writes there): ``write_atomic``'s ``.NAME.tmpPID`` files, ``.final.tmpPID`` / ``.final.oldPID``
    folders, ``checkpoints/.tmp_step_*`` folders, also in ``phases/``. Returns what was removed."""
    run_dir = Path(run_dir)
    removed = []
    for folder in (run_dir, run_dir / "checkpoints", run_dir / "phases"):
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if is_temporary(path.name):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def mark_finished(run_dir: Path, step: int, outputs: list[Path]) -> None:
    """The last write of a finished run: ``FINISHED`` with the step and every output's size and
    sha256, so a rerun trusts outputs it can check, never a flag written before them."""
    run_dir = Path(run_dir)
    files = {str(p.relative_to(run_dir)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in outputs}
    write_atomic(run_dir / FINISHED, json.dumps({"step": step, "files": files}, indent=1, sort_keys=True) + "\n")


def finished_step(run_dir: Path) -> tuple[int | None, str]:
    """``(step, "")`` when ``FINISHED`` is there and every output it lists has its size and sha256;
    else ``(None, what is missing or differs)``."""
    marker = Path(run_dir) / FINISHED
    if not marker.exists():
        return None, f"no {FINISHED} marker"
    try:
        record = json.loads(marker.read_text())
        step, files = int(record["step"]), dict(record["files"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{marker} unreadable ({err})"
    for name, expect in files.items():
        path = Path(run_dir) / name
        if not path.is_file():
            return None, f"{name} missing"
        if path.stat().st_size != expect["bytes"] or sha256_of(path) != expect["sha256"]:
            return None, f"{name} differs from {FINISHED}"
    return step, ""


class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock`` for the life of the process that trains the run;
    the kernel drops it when that process dies, however it dies."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(
                f"run folder {self.path.parent} is in use by another groupwise process (pid {holder}); "
                f"wait for it or stop it, or train into another folder with out=..."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def wait_unlocked(run_dir: Path, timeout: float, poll: float = 0.2) -> bool:
    """Wait (at most ``timeout`` seconds) until no process holds ``run_dir``'s lock; True when free
    (or never created). A process that is stopping (a killed parent's child checkpointing) is waited for."""
    path = Path(run_dir) / LOCK
    deadline = time.monotonic() + timeout
    while path.exists():
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        finally:
            os.close(fd)  # drops the probe's shared lock too
        time.sleep(poll)
    return True


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess``: the child gets ``sig`` when this process dies, however it
    dies (Linux ``PR_SET_PDEATHSIG``, kept across exec); a parent gone before the call is noticed too.
    ``prctl`` is looked up here, in the parent, so the forked child only makes the call (no loader
    lock after a fork from a process with threads). None where there is no ``prctl``."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return in_child


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
    return {
        k: (old.get(k, missing), new.get(k, missing))
        for k in sorted(old.keys() | new.keys())
        if old.get(k, missing) != new.get(k, missing)
    }


# Keys that cannot take effect on a resumed run, whatever --resume-allow says: what they decided is
# in the checkpoint (or in phases/) already. Every other key takes effect from the resumed step on:
# the trainer and its components are rebuilt from the new configuration, and a checkpointed state
# never overrides a configured value (docs/reliability.md lists the classes and their tests).
FIXED_ON_RESUME: tuple[tuple[tuple[str, ...], str], ...] = (
    (("seed",), "the seed chose the data split, the prompt order and the initial noise when the run started"),
    (
        (
            "model.path",
            "model.dtype",
            "model.lora",
            "model.policy",
            "model.params",
            "roles.*.model.path",
            "roles.*.model.dtype",
            "roles.*.model.lora",
            "roles.*.model.policy",
            "roles.*.model.params",
            "roles.*.frozen",
        ),
        "the checkpoint holds the weights this setting made (their file, dtype or adapters)",
    ),
    (
        ("update.optimizer", "roles.*.update.optimizer"),
        "the checkpoint holds that optimiser's state (moments, step counts)",
    ),
    (
        ("data.task", "data.path", "data.columns", "data.train_size", "data.on_bad_row"),
        "the training rows were fixed when the run started (the "
        "sampler's position and the prompt statistics count them)",
    ),
    (("phases",), "the phases ran before the first RL step; their outputs are in phases/ and in the checkpoint"),
)


def fixed_on_resume(key: str) -> str | None:
    """Why ``key`` (dotted) cannot change on resume, or None when it can."""
    for patterns, why in FIXED_ON_RESUME:
        if any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(key, p + ".*") for p in patterns):
            return why
    return None


def check_resume(stored: dict[str, Any], current: dict[str, Any], allowed: list[str]) -> None:
    """Refuse to resume a run under another configuration, naming each changed key, unless every
    change is under a key (or a section prefix) in ``allowed`` and none is fixed on resume
    (:data:`FIXED_ON_RESUME`: refused even when allowed, naming the key and why)."""
    changes = config_changes(stored, current)
    fixed = {k: (v, why) for k, v in changes.items() if (why := fixed_on_resume(k))}
    if fixed:
        shown = "; ".join(f"{k}: {_show(a)} -> {_show(b)} ({why})" for k, ((a, b), why) in fixed.items())
        raise ConfigError(
            f"not changeable on resume: {shown}; rerun with the stored value, or train into a new folder with out=..."
        )
    refused = {k: v for k, v in changes.items() if not any(k == a or k.startswith(a + ".") for a in allowed)}
    if refused:
        shown = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
        raise ConfigError(
            f"this run folder was started with another configuration ({shown}); rerun with the stored settings, "
            f"or allow the change with --resume-allow {','.join(refused)}, or train into a new folder with out=..."
        )


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
    if (
        renameat2 is not None
        and renameat2(at_fdcwd, os.fsencode(tmp), at_fdcwd, os.fsencode(final), _RENAME_EXCHANGE) == 0
    ):
        shutil.rmtree(tmp)  # now holds the previous final
        return
    aside = final.with_name(f".{final.name}.old{os.getpid()}")
    os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside)
