"""Run outputs: ``metrics.jsonl`` (one line per step), the progress bar, and ``reward.png``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class MetricsLog:
    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        kept: list[str] = []
        if resume_step is not None and path.exists():
            # a resumed run's log must equal the uninterrupted run's: drop lines after the checkpoint
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
        path.write_text("".join(line + "\n" for line in kept))
        self.rows = [json.loads(line) for line in kept]

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.rows.append(clean)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(clean) + "\n")


def progress_bar(console: Console | None = None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.3f}"),
        TextColumn("{task.fields[speed]:.0f} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
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
        smooth = [sum(x for x in reward[max(0, i - k + 1) : i + 1] if x is not None) / len(reward[max(0, i - k + 1) : i + 1]) for i in range(len(reward))]
        ax.plot(steps, smooth, label=f"reward ({k}-step mean)")
    if evals:
        ax.plot([s for s, _ in evals], [a for _, a in evals], "o-", label="held-out greedy accuracy")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.05, 1.05) if all(r is None or 0 <= r <= 1 for r in reward) else None
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
