"""Atomic, complete checkpoints: written to a temporary folder, fsynced, marked complete, then
renamed into place. Only folders carrying the marker are ever loaded; old ones are pruned only
after a new one is complete."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"
FAULT_ENV = "GROUPWISE_FAULT"  # test hook: SIGKILL this process at the named point of a save
_NAME = re.compile(r"^step_(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def save(run_dir: Path, step: int, state: dict[str, Any], keep_last: int = 2) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    _fault("checkpoint.before_marker")
    with open(tmp / MARKER, "w") as fh:  # written last: its presence means everything above is on disk
        fh.write(f"{step}\n")
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    _fault("checkpoint.before_rename")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    for old in complete(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / MARKER).exists() and (path / "state.pt").exists():
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def latest(run_dir: Path) -> Path | None:
    done = complete(run_dir)
    return done[-1] if done else None


def load(path: Path) -> dict[str, Any]:
    with open(Path(path) / "state.pt", "rb") as fh:
        return torch.load(fh, weights_only=False)
