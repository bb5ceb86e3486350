"""Where a run's metrics go besides ``metrics.jsonl`` (``log.backends``), and the console table of
sampled completions (``log.table_every``).

Each backend is a ``Tracker``: ``log(row, step)`` gets the step's metrics row (only its finite
numeric scalars are written), ``close()`` ends it. Only rank 0 builds them (``run.py``). Every
backend is local and offline; its package is an extra, imported when the run starts:

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` on ``<run>/tensorboard/``
  (``tensorboard --logdir <run>/tensorboard``). ``pip install 'groupwise[tensorboard]'``.
- ``wandb``: ``wandb.init(mode="offline")`` under ``<run>/wandb/``; ``WANDB_MODE=offline`` is set
  for the process, so wandb never logs in or connects (``wandb sync <run>/wandb/offline-run-*``
  uploads later, by hand). ``pip install 'groupwise[wandb]'``.
- ``trackio``: ``trackio.init`` with trackio's local store (``TRACKIO_DIR``, default
  ``~/.cache/huggingface/trackio``), project ``groupwise``, so ``trackio show --project groupwise``
  compares runs. ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL`` are ignored: nothing leaves the
  machine. ``pip install 'groupwise[trackio]'``.

**Resume.** A resumed run re-runs the steps after its checkpoint, which a killed run may have logged
already (bit for bit the same values: resume is exact). TensorBoard is opened with
``purge_step`` = the first step to run, so it hides every earlier event at or after that step (a
fresh run purges from 0: a run killed before its first checkpoint leaves nothing behind). wandb
and trackio cannot purge: the run continues under the id kept in ``<run>/tracking_id`` (new for a
fresh run), and trackio's table may hold a re-run step twice with equal values; ``wandb sync``
keeps the first.

**Table.** ``sample_table`` renders ``logging.sample_rows``' rows as a ``rich`` table, printed above
the progress bar (stderr) every ``log.table_every`` steps; default 100 [INFERRED]: the demo's 400
steps show 4 tables (steps 0, 100, 200, 300): the first completions early, to check the format,
then the change, without pushing the progress bar off the screen every 10 steps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import numbers
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from groupwise.errors import ConfigError

BACKENDS = ("tensorboard", "trackio", "wandb")  # each one's package and extra have its name


class Tracker(Protocol):
    def log(self, row: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def check_backends(names: list[str]) -> None:
    """``log.backends``: known names whose packages are installed (checked with the config, on every rank)."""
    for name in names:
        if name not in BACKENDS:
            raise ConfigError(
                f"config key log.backends: unknown backend {name!r}; allowed: {', '.join(BACKENDS)} "
                f"(metrics.jsonl is always written)"
            )
        if not _installed(name):
            raise ConfigError(
                f"config key log.backends: backend {name!r} needs the {name} package, which is not installed; "
                f"pip install 'groupwise[{name}]'"
            )


def _installed(module: str) -> bool:
    if sys.modules.get(module) is not None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numeric values of a metrics row (booleans as 0/1), without ``step``."""
    out = {}
    for key, value in row.items():
        if key == "step" or value is None or isinstance(value, (str, bytes)):
            continue
        if isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0:  # numpy / torch 0-d values too
            number = float(value)
            if math.isfinite(number):
                out[key] = number
    return out


class Trackers:
    """The run's backends as one ``Tracker``; an empty list logs nothing."""

    def __init__(self, trackers: list[Tracker] = ()):
        self.trackers = list(trackers)

    def log(self, row: dict[str, Any], step: int) -> None:
        values = scalars(row)
        for tracker in self.trackers:
            tracker.log(values, step)

    def close(self) -> None:
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:  # the others still close
                errors.append(e)
        self.trackers = []
        if errors:
            raise errors[0]


def open_trackers(names: list[str], out: Path, start_step: int, config: dict[str, Any]) -> Trackers:
    """The backends of ``log.backends`` for a run in ``out`` whose next step is ``start_step``."""
    check_backends(names)
    out, opened = Path(out), Trackers()
    run_id = _run_id(out, start_step) if {"wandb", "trackio"} & set(names) else ""
    try:
        for name in dict.fromkeys(names):
            opened.trackers.append(_OPENERS[name](out, start_step, config, run_id))
    except BaseException:
        opened.close()
        raise
    return opened


class TensorBoard:
    def __init__(self, out: Path, start_step: int, config: dict[str, Any], run_id: str):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or after the first step this run logs are hidden (the re-run replaces them)
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_step)

    def log(self, row: dict[str, Any], step: int) -> None:
        for key, value in row.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a kill loses no step before the checkpoint it resumes from

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out: Path, start_step: int, config: dict[str, Any], run_id: str):
        os.environ["WANDB_MODE"] = "offline"  # read by wandb and the service it starts: no login, no network
        import wandb

        settings = wandb.Settings(
            mode="offline", console="off", silent=True, x_disable_stats=True, disable_git=True, save_code=False
        )
        with _stdout_to_stderr():
            self.run = wandb.init(
                project="groupwise",
                name=out.name,
                id=run_id,
                resume="allow",
                dir=str(out),
                mode="offline",
                config=config,
                settings=settings,
            )

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(row, step=step)

    def close(self) -> None:
        with _stdout_to_stderr():
            self.run.finish()


class Trackio:
    def __init__(self, out: Path, start_step: int, config: dict[str, Any], run_id: str):
        import trackio

        with _stdout_to_stderr(), _without_env("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
            self.run = trackio.init(
                project="groupwise",
                name=f"{out.name}-{run_id}",
                resume="allow",
                config=config,
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(row, step=step)

    def close(self) -> None:
        import trackio

        with _stdout_to_stderr():
            # not run.finish(): that leaves the run current, and trackio's atexit hook finishes it again on stdout
            trackio.finish()


_OPENERS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}


def _run_id(out: Path, start_step: int) -> str:
    """The run's id in wandb / trackio: kept in ``<run>/tracking_id`` for a resumed run, new for a fresh one."""
    from groupwise.runfolder import write_atomic

    path = out / "tracking_id"
    out.mkdir(parents=True, exist_ok=True)
    if start_step > 0 and path.exists() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)
    write_atomic(path, run_id + "\n")
    return run_id


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    with contextlib.redirect_stdout(sys.stderr):  # stdout stays the caller's (the Python API, pipes)
        yield


@contextlib.contextmanager
def _without_env(*names: str) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


# ------------------------------------------------------------------ the console table
def _clip(text: Any, width: int, keep_end: bool = False) -> str:
    text = "" if text is None else str(text).replace("\n", "⏎")
    if len(text) <= width:
        return text
    return "…" + text[-(width - 1) :] if keep_end else text[: width - 1] + "…"


def _number(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt) if isinstance(value, (int, float)) else _clip(value, 12)


def sample_table(rows: list[dict[str, Any]], width: int = 48) -> Any:
    """A ``rich.table.Table`` of ``sample_rows``' rows: the prompt's end and the completion's start
    (each at most ``width`` characters, newlines as ⏎), reward as ``0.250``, advantage as
    ``+0.866`` / ``-0.866``, a missing value as ``—``, then the reward functions' extra columns."""
    from rich.table import Table
    from rich.text import Text

    extras = list(dict.fromkeys(k for row in rows for k in row.get("extra", {})))
    step = rows[0]["step"] if rows else "?"
    table = Table(title=f"samples at step {step}", title_justify="left", show_lines=False)
    table.add_column("prompt", overflow="fold", max_width=width)
    table.add_column("completion", overflow="fold", max_width=width)
    table.add_column("reward", justify="right")
    table.add_column("advantage", justify="right")
    for key in extras:
        table.add_column(_clip(key, 16), justify="right")
    for row in rows:  # Text: a completion's "[bold]" is shown, not read as markup
        cells = [
            _clip(row.get("prompt"), width, keep_end=True),
            _clip(row.get("completion"), width),
            _number(row.get("reward"), ".3f"),
            _number(row.get("advantage"), "+.3f"),
        ]
        cells += [_number(row.get("extra", {}).get(key), ".3f") for key in extras]
        table.add_row(*map(Text, cells))
    return table
