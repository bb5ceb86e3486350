"""Uniform prompt sampling: epochs over a seeded permutation of the dataset rows.

Standard practice (TRL's ``RepeatSampler``, verl's shuffled dataloader); no paper.

**Change vs GRPO**: none — GRPO samples prompts uniformly without replacement within an epoch.

**Math**::

    perm_e = randperm(n_rows, seed + e)          (e = epoch; identity when shuffle=False)
    draw(n) = the next n entries of perm_0 ‖ perm_1 ‖ …

**Defaults**

- ``shuffle = True`` [CODE] TRL / verl shuffle the training prompts by default.
- ``max_rounds = 1`` (class constant): every drawn group is kept, one round fills the batch.

**Notes**

1. The position is (epoch, index in the epoch's permutation); a draw that crosses the end of an
   epoch continues into the next epoch's permutation, so no row repeats within an epoch.
2. ``state_dict`` / ``load_state_dict`` hold (position, epoch) plus (n_rows, seed) for checking:
   the permutation is recomputed from ``seed + epoch``, so a resumed run draws exactly the rows
   the uninterrupted run would (DESIGN §8). ``bind`` does not reset the position, so it may be
   called before or after ``load_state_dict``.
3. The permutation uses its own ``torch.Generator`` and never touches the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("sampling", "uniform")
@dataclass
class UniformSampler:
    """Seeded shuffled epochs over the dataset, every group kept (standard GRPO sampling)."""

    shuffle: bool = True

    max_rounds: ClassVar[int] = 1

    def __post_init__(self) -> None:
        self._n_rows: int | None = None
        self._seed = 0
        self._epoch = 0
        self._position = 0
        self._perm: list[int] | None = None

    # ------------------------------------------------------------------ drawing
    def bind(self, n_rows: int, seed: int) -> None:
        if n_rows < 1:
            raise ValueError(f"{self.registry_name}: the dataset has no rows")
        if self._n_rows is not None and self._n_rows != n_rows and (self._epoch or self._position):
            raise ValueError(
                f"{self.registry_name}: resumed state was for {self._n_rows} rows, the dataset has {n_rows}"
            )
        self._n_rows, self._seed, self._perm = int(n_rows), int(seed), None

    def _order(self, epoch: int) -> list[int]:
        assert self._n_rows is not None
        if not self.shuffle:
            return list(range(self._n_rows))
        gen = torch.Generator().manual_seed((self._seed + epoch) % (2**63))
        return torch.randperm(self._n_rows, generator=gen).tolist()

    def draw(self, n: int, info: StepInfo | None = None) -> list[int]:
        if self._n_rows is None:
            raise RuntimeError(f"{self.registry_name}: call bind(n_rows, seed) before draw")
        ids: list[int] = []
        while len(ids) < n:
            if self._perm is None:
                self._perm = self._order(self._epoch)
            take = min(n - len(ids), self._n_rows - self._position)
            ids.extend(self._perm[self._position : self._position + take])
            self._position += take
            if self._position == self._n_rows:
                self._epoch, self._position, self._perm = self._epoch + 1, 0, None
        return ids

    def keep(self, rollout: Rollout) -> Tensor:
        return torch.ones(rollout.shape[0], dtype=torch.bool)  # [B]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"position": self._position, "epoch": self._epoch, "n_rows": self._n_rows, "seed": self._seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n_rows, seed = state.get("n_rows"), state.get("seed", self._seed)
        if self._n_rows is not None and n_rows is not None and n_rows != self._n_rows:
            raise ValueError(f"{self.registry_name}: state is for {n_rows} rows, bound to {self._n_rows}")
        if self._n_rows is None:
            self._n_rows = n_rows
        self._seed = int(seed)
        self._position, self._epoch, self._perm = int(state["position"]), int(state["epoch"]), None
