"""Reach the target: a small built-in multi-turn text game the embedded model can act in.

The state is a position ``p`` and a goal ``q > p``; the observation is the distance left,
``"left 4="`` (at 7, goal 11). An action is one digit ``d`` in ``1..max_move``: the position moves to
``p + d``. The episode is won (reward 1) by landing on the goal exactly within the row's turn
limit; overshooting ends it lost (reward 0), and so does running out of turns. Any other action
text (``"0"``, ``"5"``, ``"12"``, empty) is an invalid move: the position stays, the turn is spent.

Why this rendering: the embedded model was fine-tuned only on ``"a+b="``, so the observation ends
with ``=`` (after ``"7>11:"`` it emits EOS with probability 0.999; after ``"left 4="`` a digit in
1–4 about 84 % of the time). An observation with both numbers (``"7>11="``) was tried: the policy
had to subtract two-digit numbers and collapsed to "always 4" in every 150-step run (GROW and
``episodes`` alike); with the distance shown, the endgame (play exactly the rest) is learnable.

Tasks (rows ``{"prompt", "answer", "env", "start", "goal", "turns"}``, ``prompt`` = the first
observation, ``answer`` = one shortest plan, ``turns = ceil(dist / 4) + SLACK``):

- ``reach``: start ``0..49``, distance ``1..16`` (1–4 moves, 2.5 on average; ≥ 3 for half the rows);
- ``reach_long``: start ``0..59``, distance ``29..40`` (8–10 moves: the long-horizon variant).

A fixed seeded permutation of each task's (start, goal) pairs puts the first ``TEST_SIZE`` in
``test``. The observation shows the distance only, so a held-out pair is a new episode over the
same states: held-out accuracy measures the greedy policy, not generalisation.

**Change vs GRPO**: none by itself — an environment (``env`` stage, ``reach``) for the multi-turn
rollout strategies (``grow``, ``episodes``) and its tasks.

**Math**::

    reset(row):  p = start, q = goal, left = turns                 → "left {q − p}="
    step(a):     left -= 1; if a.strip() is a digit d in 1..max_move: p += d
                 reward = 1 if p == q else 0;  done = p >= q or left == 0
    action_value(row, a) = Q*(start, a) = 1 if a is valid, d <= q − p and
                           ceil((q − p − d) / max_move) <= turns − 1, else 0

**Defaults**

- ``max_move = 4`` [INFERRED] digits 1–4, as the issue suggested; a shortest path is then
  ``ceil(dist / 4)`` moves.
- tasks: ``SLACK = 0`` [INFERRED] the turn limit is the shortest path: every move must lie on one
  (an invalid move loses), so the reward separates good play from lucky play.

**Notes**

1. ``action_value`` is the best return still reachable after one action from the row's start
   state (the env is deterministic): reward ``env_return`` scores a lone completion with it, which
   is what held-out evaluation (one greedy action per start state) measures.
2. The seed of ``reset`` is unused: the game is deterministic (the contract allows random envs).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from functools import cache

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.tasks import Task, register_task, split_pool

MAX_MOVE = 4
SLACK = 0
TEST_SIZE = 200
_SPLIT_SEED = 404
SIZES = {"reach": ((0, 49), (1, 16)), "reach_long": ((0, 59), (29, 40))}  # (start range, distance range)


def render(pos: int, goal: int) -> str:
    return f"left {goal - pos}="  # past the goal: a negative distance


def parse_move(action: str, max_move: int = MAX_MOVE) -> int | None:
    """The move of an action text (``"3"`` or ``" 3"`` → 3); ``None`` for an invalid move."""
    text = action.strip() if isinstance(action, str) else ""
    return int(text) if len(text) == 1 and text.isdigit() and 1 <= int(text) <= max_move else None


@register("env", "reach")
@dataclass
class Reach:
    """Reach the goal exactly with moves of 1..max_move within the row's turn limit (one episode per instance)."""

    max_move: int = MAX_MOVE
    pos: int = field(default=0, init=False)
    goal: int = field(default=0, init=False)
    left: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.max_move <= 9:
            raise ConfigError(f"env reach: max_move must be in 1..9 (one digit), got {self.max_move}")

    def reset(self, row: dict, seed: int) -> str:
        self.pos, self.goal, self.left = int(row["start"]), int(row["goal"]), int(row["turns"])
        return render(self.pos, self.goal)

    def step(self, action: str) -> tuple[str, float, bool]:
        move = parse_move(action, self.max_move)
        self.left -= 1
        self.pos += move or 0
        reward = 1.0 if self.pos == self.goal else 0.0
        return render(self.pos, self.goal), reward, self.pos >= self.goal or self.left <= 0

    def action_value(self, row: dict, action: str) -> float:
        """Q*(start, action): 1 when winning is still possible after this one action, else 0."""
        move, dist = parse_move(action, self.max_move), int(row["goal"]) - int(row["start"])
        if move is None or move > dist:
            return 0.0
        return 1.0 if math.ceil((dist - move) / self.max_move) <= int(row["turns"]) - 1 else 0.0


def plan(dist: int, max_move: int = MAX_MOVE) -> list[int]:
    """One shortest plan: full moves, then the remainder."""
    return [max_move] * (dist // max_move) + ([dist % max_move] if dist % max_move else [])


def format_row(start: int, goal: int) -> dict:
    """``{"prompt": "left 4=", "answer": "4", "env": "reach", "start": 7, "goal": 11, "turns": 1}``."""
    moves = plan(goal - start)
    return {
        "prompt": render(start, goal),
        "answer": " ".join(map(str, moves)),
        "env": "reach",
        "start": start,
        "goal": goal,
        "turns": len(moves) + SLACK,
    }


@cache
def _problems(task: str) -> tuple[tuple[int, int], ...]:
    (lo, hi), (dlo, dhi) = SIZES[task]
    pairs = [(s, s + d) for s in range(lo, hi + 1) for d in range(dlo, dhi + 1)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return tuple(pairs)


def _rows(task: str):
    def rows(split: str, n: int, seed: int = 0) -> list[dict]:
        """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
        return [format_row(s, g) for s, g in split_pool(_problems(task), split, n, seed, TEST_SIZE, task)]

    return rows


register_task(
    Task(
        "reach",
        "multi-turn: land exactly on the goal with moves 1-4 ('left "
        "6=' -> '4', 'left 2=' -> '2'), 1-4 moves; reward env_return",
        _rows("reach"),
        reward="env_return",
    )
)
register_task(
    Task(
        "reach_long",
        "multi-turn reach with 8-10 moves (distance 29-40); reward env_return",
        _rows("reach_long"),
        reward="env_return",
    )
)
