"""``PromptStats``: one per-prompt statistics table shared by every component of a run.

Curricula and trackers (CGPO, FG-ExPO's Gaussian curriculum, HORA's budgets) all need "how has
this prompt done so far". Instead of each keeping its own copy, the trainer owns one table, updates
it once per step from the step's whole batch (all ranks, after the update), hands it to components
as ``StepInfo.prompt_stats`` and checkpoints it, so a resumed run sees exactly the same table.

Keyed by the dataset row id (``rollout.prompt_index``). Per prompt it keeps: how many times its
group was trained on (``seen``), the step it was last seen, the last ``history`` group means of its
valid rewards and their population variances, and the running sum / count of every valid reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from groupwise.types import Rollout, StepInfo


@dataclass
class _Entry:
    seen: int = 0
    last_step: int = -1
    means: list[float] = field(default_factory=list)  # most recent last
    variances: list[float] = field(default_factory=list)
    reward_sum: float = 0.0
    reward_count: int = 0


class PromptStats:
    """Per-prompt reward history of the run (see the module docstring)."""

    def __init__(self, history: int = 8):
        if history < 1:
            raise ValueError(f"PromptStats: history must be >= 1, got {history}")
        self.history = history
        self._table: dict[int, _Entry] = {}

    # ------------------------------------------------------------------ update
    def update(self, rollout: Rollout, info: StepInfo) -> None:
        """Record every group of the step batch whose prompt has at least one valid reward."""
        if rollout.rewards is None:
            raise ValueError("PromptStats.update needs a scored rollout (rewards filled)")
        r = rollout.rewards.double()  # [B,G]
        valid = rollout.group_valid.bool() & torch.isfinite(r)  # [B,G]
        for b, prompt in enumerate(rollout.prompt_index.tolist()):
            values = r[b][valid[b]]  # [n]
            if values.numel() == 0:
                continue
            entry = self._table.setdefault(int(prompt), _Entry())
            mean = float(values.mean())
            entry.seen += 1
            entry.last_step = info.step
            entry.means = (entry.means + [mean])[-self.history :]
            entry.variances = (entry.variances + [float(((values - mean) ** 2).mean())])[-self.history :]
            entry.reward_sum += float(values.sum())
            entry.reward_count += int(values.numel())

    # ------------------------------------------------------------------ queries
    def seen(self, prompt: int) -> int:
        entry = self._table.get(int(prompt))
        return entry.seen if entry else 0

    def last_step(self, prompt: int) -> int:
        entry = self._table.get(int(prompt))
        return entry.last_step if entry else -1

    def last_mean(self, prompt: int, default: float) -> float:
        """Mean valid reward of the prompt's most recent group (``default`` if never seen)."""
        entry = self._table.get(int(prompt))
        return entry.means[-1] if entry and entry.means else default

    def recent_means(self, prompt: int) -> list[float]:
        entry = self._table.get(int(prompt))
        return list(entry.means) if entry else []

    def recent_variances(self, prompt: int) -> list[float]:
        entry = self._table.get(int(prompt))
        return list(entry.variances) if entry else []

    def running_mean(self, prompt: int, default: float) -> float:
        """Mean of every valid reward the prompt has received (``default`` if never seen)."""
        entry = self._table.get(int(prompt))
        return entry.reward_sum / entry.reward_count if entry and entry.reward_count else default

    def prompts(self) -> list[int]:
        return sorted(self._table)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "table": {p: vars(e).copy() for p, e in self._table.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = int(state["history"])
        self._table = {
            int(p): _Entry(**{k: (list(v) if isinstance(v, list) else v) for k, v in e.items()})
            for p, e in state["table"].items()
        }
