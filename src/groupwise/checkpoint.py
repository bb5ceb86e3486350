"""Atomic, self-verifying checkpoints.

A save writes ``state.pt`` to a temporary folder, then ``MANIFEST.json`` (the step and each file's
size and sha256), then the ``COMPLETE`` marker holding the manifest's own sha256, fsyncing each,
and renames the folder into place. A load checks all three against each other, so a bit flip, a
zeroed page, a truncation or an edited field is found and named before anything is unpickled;
:func:`latest_intact` then falls back to the previous complete checkpoint.

No moment of a save leaves a run without a complete checkpoint: a second save of the same step
gets a new revision name (``step_000010_r1``) instead of replacing the folder, and old folders are
pruned only after the new one is published. A full disk is found before writing where possible
(free space against the state's size) and otherwise when the write fails; either way the error
names the path and the bytes needed, and the temporary folder is removed.

Sharded training (``dist.shard="fsdp2"``): every rank calls :func:`save`. The sharded tensors of the
state (FSDP2's DTensors: weights and optimiser moments) are written by their ranks, each its own
shard, through ``torch.distributed.checkpoint`` into ``shards/``; in ``state.pt`` (rank 0) each of
them is a :class:`Sharded` placeholder naming its key. The manifest lists and hashes every shard file
as well, so the integrity checks cover the whole checkpoint. :func:`load` reads each sharded tensor
whole (``torch.distributed.checkpoint`` reassembles it from the shards of any number of ranks), and
the policy and updater keep their own shard of it: a checkpoint saved at one world size resumes at
any other.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from groupwise.runfolder import NoSpace, is_no_space, no_space, sha256_of

MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
STATE = "state.pt"
SHARDS = "shards"  # torch.distributed.checkpoint folder of the sharded tensors (every rank writes its shards)
FAULT_ENV = "GROUPWISE_FAULT"  # test hook: SIGKILL this process at the named point of a save
_NAME = re.compile(r"^step_(\d+)(?:_r(\d+))?$")


class CheckpointCorrupt(RuntimeError):
    """A checkpoint folder whose files do not match its manifest (the message names file and check)."""


class CheckpointSpace(NoSpace):
    """The disk cannot hold the checkpoint; the message names the path, the bytes needed and free."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


_sha256 = sha256_of


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


class _Writes:
    """A file for ``torch.save`` that keeps the first ``OSError`` of a write (ENOSPC, EDQUOT)."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.error = fh, None

    def write(self, data: Any) -> int:
        try:
            return self.fh.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.fh.flush()


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _next_name(root: Path, step: int) -> Path:
    """``step_N`` or, if a checkpoint of this step exists already, its next revision ``step_N_rK``."""
    revisions = [int(m.group(2) or 0) for p in root.iterdir() if (m := _NAME.match(p.name)) and int(m.group(1)) == step]
    base = f"step_{step:06d}"
    return root / (base if not revisions else f"{base}_r{max(revisions) + 1}")


@dataclass(frozen=True)
class Sharded:
    """In ``state.pt``: a sharded tensor of the state, stored under ``key`` in the ``shards/`` folder."""

    key: str


def split_sharded(state: Any) -> tuple[Any, dict[str, Any]]:
    """(``state`` with every sharded tensor replaced by a :class:`Sharded` placeholder, {key: tensor});
    the state itself and {} when nothing in it is sharded. Keys are the tensors' paths in the state."""
    from groupwise.dist import is_sharded

    shards: dict[str, Any] = {}

    def walk(obj: Any, path: str) -> Any:
        if is_sharded(obj):
            shards[path] = obj
            return Sharded(path)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the mapping's type and attributes (a module state dict's _metadata)
            for key, value in obj.items():
                out[key] = walk(value, f"{path}/{key}")
            return out
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v, f"{path}/{i}") for i, v in enumerate(obj))
        return obj

    out = walk(state, "")
    return (out, shards) if shards else (state, {})


def _fill_sharded(state: Any, folder: Path) -> Any:
    """``state`` with each :class:`Sharded` placeholder replaced by its whole tensor from ``folder``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    whole = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in metadata.items()}
    dcp.load(whole, storage_reader=reader, no_dist=not dist.is_initialized())

    def walk(obj: Any) -> Any:
        if isinstance(obj, Sharded):
            return whole[obj.key]
        if isinstance(obj, dict):
            out = copy.copy(obj)
            for key, value in obj.items():
                out[key] = walk(value)
            return out
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(state)


def save(run_dir: Path, step: int, state: dict[str, Any], keep_last: int = 2) -> Path | None:
    """Write the step's checkpoint (module docstring) and prune older ones; the folder it published.
    Under torchrun every rank calls it; a rank other than 0 writes only its shards (returns None)."""
    import torch.distributed as dist

    state, shards = split_sharded(state)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0 and not shards:  # a whole state: rank 0 holds all of it
        return None
    root = Path(run_dir) / "checkpoints"
    tmp = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        needed = _tensor_bytes(state) + _tensor_bytes(shards) + (1 << 16)  # tensors dominate; 64 KiB for the rest
        free = shutil.disk_usage(root).free
        if free < needed:
            raise CheckpointSpace(
                errno.ENOSPC,
                f"no space for the step-{step} checkpoint in {root}: it needs about {needed:,} bytes, "
                f"{free:,} are free; free some space (or lower checkpoint.keep_last) and rerun the same command to "
                f"resume from the last complete checkpoint",
            )
        tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if shards:  # every rank writes its own shard of each sharded tensor (a collective)
        import torch.distributed.checkpoint as dcp

        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        dcp.save(shards, checkpoint_id=str(box[0] / SHARDS))
        _fault("checkpoint.after_shards")
        if rank != 0:
            return None
    try:
        with open(tmp / STATE, "wb") as fh:
            writer = _Writes(fh)
            try:
                torch.save(state, writer)
            except RuntimeError as err:  # torch's writer hides the OSError behind its own message
                raise (writer.error or err) from err
            fh.flush()
            os.fsync(fh.fileno())
        # hashed as read back: the manifest describes the bytes the disk holds
        files = sorted(p for p in tmp.rglob("*") if p.is_file())  # state.pt and every rank's shard files
        for file in files:
            if file.parent != tmp:
                _fsync_file(file)
        manifest = {
            "step": step,
            "files": {str(f.relative_to(tmp)): {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files},
        }
        manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
        _write(tmp / MANIFEST, manifest_bytes)
        _fault("checkpoint.before_marker")
        # last: everything above is on disk
        _write(tmp / MARKER, f"{step} {hashlib.sha256(manifest_bytes).hexdigest()}\n".encode())
        if (tmp / SHARDS).exists():
            _fsync_dir(tmp / SHARDS)
        _fsync_dir(tmp)
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(err):
            full = no_space(
                f"the step-{step} checkpoint",
                tmp,
                needed,
                err,
                "the partial folder was removed, earlier checkpoints are intact; free some space and rerun to resume",
            )
            raise CheckpointSpace(full.errno, full.strerror) from err
        raise
    _fault("checkpoint.before_rename")
    final = _next_name(root, step)
    os.rename(tmp, final)
    _fsync_dir(root)
    _fault("checkpoint.before_prune")
    done = complete(run_dir)
    # same step, older revision
    superseded = [p for p in done if p != final and _NAME.match(p.name).group(1) == _NAME.match(final.name).group(1)]
    others = [p for p in done if p not in superseded]
    for old in superseded + (others[:-keep_last] if keep_last > 0 else []):
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete(run_dir: Path) -> list[Path]:
    """Checkpoint folders carrying the marker, oldest first (by step, then revision). Not verified."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / MARKER).exists() and (path / STATE).exists():
            found.append((int(match.group(1)), int(match.group(2) or 0), path))
    return [p for _, _, p in sorted(found)]


def verify(path: Path) -> None:
    """Raise :class:`CheckpointCorrupt` naming the file and the failed check, unless the marker,
    the manifest and every listed file agree (sizes and sha256)."""
    path = Path(path)
    match = _NAME.match(path.name)
    try:
        marker = (path / MARKER).read_text().split()
        manifest_bytes = (path / MANIFEST).read_bytes()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointCorrupt(f"{path}: cannot read {MARKER}/{MANIFEST} ({err})") from err
    if len(marker) != 2 or not marker[0].isdigit():
        raise CheckpointCorrupt(f"{path / MARKER}: malformed marker {' '.join(marker)[:80]!r}")
    if hashlib.sha256(manifest_bytes).hexdigest() != marker[1]:
        raise CheckpointCorrupt(
            f"{path / MANIFEST}: sha256 differs from the one recorded in {MARKER} (edited or damaged)"
        )
    manifest = json.loads(manifest_bytes)
    if match is None or int(marker[0]) != manifest["step"] or int(match.group(1)) != manifest["step"]:
        raise CheckpointCorrupt(
            f"{path}: folder name, {MARKER} ({marker[0]}) and {MANIFEST} (step {manifest['step']}) disagree"
        )
    for name, expect in manifest["files"].items():
        file = path / name
        if not file.exists():
            raise CheckpointCorrupt(f"{file}: listed in {MANIFEST} but missing")
        size = file.stat().st_size
        if size != expect["bytes"]:
            raise CheckpointCorrupt(
                f"{file}: {size:,} bytes, {MANIFEST} says {expect['bytes']:,} (truncated or extended)"
            )
        if _sha256(file) != expect["sha256"]:
            raise CheckpointCorrupt(f"{file}: sha256 differs from {MANIFEST} (bit flip or overwritten bytes)")


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, unverified (see :func:`latest_intact`)."""
    done = complete(run_dir)
    return done[-1] if done else None


def latest_intact(run_dir: Path) -> Path | None:
    """The newest checkpoint that passes :func:`verify`; each damaged newer one is named in a warning.
    None when the run has no checkpoint; :class:`CheckpointCorrupt` when every one is damaged."""
    done = complete(run_dir)
    problems = []
    for path in reversed(done):
        try:
            verify(path)
        except CheckpointCorrupt as err:
            problems.append(str(err))
            warnings.warn(f"skipping damaged checkpoint: {err}", RuntimeWarning, stacklevel=2)
            continue
        return path
    if problems:
        raise CheckpointCorrupt(f"no intact checkpoint in {Path(run_dir) / 'checkpoints'}: " + "; ".join(problems))
    return None


def load(path: Path) -> dict[str, Any]:
    """The state of a checkpoint folder, verified against its manifest first."""
    verify(path)
    with open(Path(path) / STATE, "rb") as fh:
        # a GPU run resumes anywhere; load_state_dict moves back
        state = torch.load(fh, map_location="cpu", weights_only=False)
    if (Path(path) / SHARDS).exists():  # every rank reads each sharded tensor whole (at any world size)
        state = _fill_sharded(state, Path(path) / SHARDS)
    return state
