"""Run outputs: ``metrics.jsonl`` (one line per step), the progress bar, and ``reward.png``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from groupwise.runfolder import is_no_space, no_space, write_atomic


class MetricsLog:
    """``metrics.jsonl``: one JSON line per step, appended and fsynced as each step ends.

    Opening it for a resumed run keeps the steps up to the checkpoint (the resumed run writes the
    rest again, identically) and rewrites the file atomically: a kill at any moment leaves either
    the old file or the new one. A torn last line (power loss, full disk) is dropped, and a step
    logged twice keeps its last line, so no step appears twice whatever was killed when. A full
    disk during an append is :class:`~groupwise.runfolder.NoSpace` naming the file and the bytes."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        self.rows = logged_rows(path, resume_step) if resume_step is not None else []
        write_atomic(path, "".join(json.dumps(row) + "\n" for row in self.rows))

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.rows.append(clean)
        _append(self.path, json.dumps(clean) + "\n", f"step {clean.get('step')}'s metrics")


def logged_rows(path: Path, last_step: int) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` up to ``last_step``, one per step (its last line), in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_bytes().split(b"\n"):
            row = _parse(line)
            if row is not None and row["step"] <= last_step:
                by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def _append(path: Path, text: str, what: str) -> None:
    """Append and fsync; a full disk is named (what, where, bytes needed and free), not a bare ``Errno 28``.
    A torn line it may leave is dropped on resume."""
    data = text.encode()
    try:
        with open(path, "ab") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:
        if is_no_space(err):
            raise no_space(what, path, len(data), err) from err
        raise


def _parse(line: bytes) -> dict[str, Any] | None:
    """A logged row, or None for a blank, torn or foreign line."""
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def sample_rows(batch: Any, step: int, n: int) -> list[dict[str, Any]]:
    """Up to ``n`` rows of the step's batch for ``samples.jsonl``: the first row of each group in turn
    (then the second, ...), with prompt, completion, reward and the row's (mean) advantage, and under
    ``"extra"`` the columns reward functions logged for the row with ``log_extra`` (only when there are
    any; a value JSON cannot hold is written as its ``str``, a non-finite float as ``null``), and the
    fields a rollout strategy put in the row's ``info["log"]`` (an agent's ``transcript`` and ``turns``)."""
    B, G, _ = batch.shape
    out: list[dict[str, Any]] = []
    for g, b in ((g, b) for g in range(G) for b in range(B)):
        if len(out) == n:
            break
        if not bool(batch.group_valid[b, g]):
            continue
        advantage = None
        if batch.advantages is not None:
            adv, mask = batch.advantages[b, g], batch.mask[b, g]  # [] or [T], [T]
            advantage = float(adv) if adv.dim() == 0 else float(adv[mask].mean()) if mask.any() else None
        reward = float(batch.rewards[b, g])
        out.append(
            {
                "step": step,
                "prompt": batch.meta[b].get("prompt") if batch.meta else None,
                "completion": batch.completions[b][g] if batch.completions else None,
                "reward": reward if math.isfinite(reward) else None,
                "advantage": advantage,
            }
        )
        info = batch.info[b][g] if batch.info else None
        if isinstance(info, dict) and info.get("extra"):
            out[-1]["extra"] = {str(k): _jsonable(v) for k, v in info["extra"].items()}
        if isinstance(info, dict) and isinstance(info.get("log"), dict):
            out[-1].update({str(k): _jsonable(v) for k, v in info["log"].items() if str(k) not in out[-1]})
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if v is None or isinstance(v, (str, int, bool)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if hasattr(v, "tolist"):  # numpy / torch values
        return _jsonable(v.tolist())
    return str(v)


def append_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    _append(path, "".join(json.dumps(row) + "\n" for row in rows), f"{len(rows)} sample rows")


def cut_back(path: Path, resume_step: int | None) -> None:
    """Keep the rows of ``path`` (JSON lines with a ``step``) up to ``resume_step`` (none for a fresh
    run), rewritten atomically: a resumed run appends the later steps again, so none appears twice."""
    if not path.exists():
        return
    rows = [row for row in map(_parse, path.read_bytes().split(b"\n")) if row is not None]
    keep = [] if resume_step is None else [row for row in rows if row["step"] <= resume_step]
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in keep))


def progress_bar(console: Console | None = None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.3f}"),
        TextColumn("{task.fields[kl]}"),
        TextColumn("{task.fields[speed]:.0f} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console
        if console is not None
        else Console(stderr=True),  # stdout stays the caller's (the Python API, pipes)
        transient=False,
    )


def plot_rewards(rows: list[dict], evals: list[tuple[int, float]], path: Path) -> None:
    """Learning curve: reward mean per step (and its moving average), held-out accuracy points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    reward = [r.get("reward_mean") for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, reward, alpha=0.35, label="reward (batch mean)")
    if len(reward) >= 5:
        k = max(2, len(reward) // 15)
        smooth = [
            sum(x for x in reward[max(0, i - k + 1) : i + 1] if x is not None) / len(reward[max(0, i - k + 1) : i + 1])
            for i in range(len(reward))
        ]
        ax.plot(steps, smooth, label=f"reward ({k}-step mean)")
    if evals:
        ax.plot([s for s, _ in evals], [a for _, a in evals], "o-", label="held-out greedy accuracy")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.05, 1.05) if all(r is None or 0 <= r <= 1 for r in reward) else None
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # replaced whole: a kill never leaves a torn image
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
