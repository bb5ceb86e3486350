"""Both directions of a problem in one group: its forward and its reverse question are sampled in the
same step and their rows pooled into one group, each row under its own question.

For DGPO (specs/40, ``losses/dgpo.py``): "group forward QA and constructed reverse QA candidates for
the same problem". The data is ``papers/40_dgpo/fobar.py`` (rows with a ``problem`` id and a ``direction``).

**Change vs GRPO**: a group is a problem, not a prompt. Each drawn row's problem contributes all its
rows (forward and reverse), ``G`` samples of each, scored against their own row; the rows are then
regrouped into one group per problem, every row keeping its own context (``Rollout.ctx``), with the
row extra ``direction`` (0, 1, … by the order a problem's directions first appear in the data).

**Math** (``B = rollout.prompts_per_step``, ``G = rollout.group_size``)::

    ids    = ctx.draw(ceil(B / 2))                                  problems of the drawn rows
    rows   = [Request(key=k, n=G) for i in ids for k in keys(problem(i))]   forward, reverse
    batch  = ctx.rollout(rows)                                      scored, each row by its own row
    pooled = batch.regroup(one group per problem)                   [ceil(B/2), 2G] for paired data
    return pooled[ctx.keep(pooled)]

**Defaults** (all [INFERRED])

- ``problem_column = "problem"``, ``direction_column = "direction"`` (task ``fobar``'s columns).
- ``ceil(B / 2)`` problems a step: with two directions a step samples B·G rows, as rollout ``sample``.

**Notes**

1. The partners come from the train rows (``use_rows``, at build). A problem that has only one row
   (``data.train_size`` cut its pair) is sampled alone; a row without the columns is an error.
2. Group-level fields of a pooled group (``meta``, ``prompt_index``, the logged sample's prompt)
   are its first row's (the forward question). Advantage estimators see the pooled group: GRPO's
   advantage then centres over both directions (use rollout ``sample`` on task ``fobar`` for
   per-direction groups). The same problem drawn twice is one group twice.
3. One round: a sampler that drops groups (dynamic sampling) filters the pooled groups once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.types import Request, Rollout

DIRECTION = "direction"


@register("rollout", "directions")
@dataclass
class Directions:
    """A problem's forward and reverse questions sampled together and pooled into one group (DGPO)."""

    problem_column: str = "problem"
    direction_column: str = "direction"

    request_options = ()
    collects = (DIRECTION,)

    def __post_init__(self) -> None:
        self._keys: dict = {}  # problem -> its row keys, in direction order
        self._problem: list = []  # row key -> problem
        self._direction: list[int] = []  # row key -> direction index

    def use_rows(self, rows: list[dict]) -> None:
        order: dict = {}
        self._keys, self._problem, self._direction = {}, [], []
        for key, row in enumerate(rows):
            for column in (self.problem_column, self.direction_column):
                if column not in row:
                    raise ConfigError(
                        f"rollout directions: train row {key} has no column {column!r} (it has {sorted(row)}); "
                        f"use task 'fobar' or rows with a problem id and a direction"
                    )
            d = order.setdefault(row[self.direction_column], len(order))
            self._problem.append(row[self.problem_column])
            self._direction.append(d)
            self._keys.setdefault(row[self.problem_column], []).append(key)
        for keys in self._keys.values():
            keys.sort(key=lambda k: self._direction[k])

    def __call__(self, ctx: RolloutContext) -> Rollout:
        if not self._problem:
            raise ConfigError("rollout directions was given no train rows (use_rows); the trainer binds them at build")
        G = ctx.group_size
        ids = ctx.draw(max(1, -(-ctx.batch_size // 2)))
        keys = [self._keys[self._problem[i]] for i in ids]  # [problems][directions]
        requests = [Request(key=k, n=G) for ks in keys for k in ks]
        batch = ctx.rollout(requests)
        B, Gb = batch.group_valid.shape
        direction = torch.tensor([self._direction[r.key] for r in requests])  # [B]
        batch.set_extra(DIRECTION, direction[:, None].expand(B, Gb).clone(), "row")  # [B,G]
        slots, start = [], 0
        for ks in keys:
            groups = range(start, start + len(ks))
            slots.append(
                [(b, g) for b in groups for g in batch.group_valid[b].nonzero().flatten().tolist()] or [(start, 0)]
            )
            start += len(ks)
        pooled = batch.regroup(slots)  # [P, directions·G], each row under its own question
        keep = ctx.keep(pooled)  # [P] bool
        return pooled.select(keep.nonzero().flatten())
