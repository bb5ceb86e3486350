"""Key and door: a two-decision text game where the first move is necessary but not sufficient (spec 23's toy).

Turn 1 shows ``"pick 1-4="``: the digit ``key`` picks up the key, any other action does nothing.
Turn 2 shows the door with its code, ``"door 3 key="`` when the agent holds the key, ``"door 3="``
when it does not. The door opens iff the agent holds the key and the action is the code: reward 1,
done. A closed door shows the same observation again until the turn limit. The code is fixed per
dataset row, so the G episodes of a row revisit the same door states: GAGPO's grouped value has
repeats to average, and "pick the key, then miss the code" is the common failure the spec's
behavioural test names (GRPO blames the key pick in every such episode).

Why this rendering: the embedded model was fine-tuned on ``"a+b="`` only, so every observation ends
with ``=`` and an action is one digit (``tasks/reach.py``). Its greedy answer after ``"pick 1-4="``
is ``1`` (probability 0.68; ``2``: 0.13, ``3``: 0.05, ``4``: 0.03), so the key is ``2`` by
default: with the design note's ``1`` the untrained model would already score 1.0 held out.

**Change vs GRPO**: none by itself — an environment (``env`` stage, ``keydoor``) and its task, for
the multi-turn strategy ``episodes``.

**Math** (row with code c; ``left`` = 2 + slack turns)::

    reset(row):  key = False, left = 2 + slack              → "pick 1-4="
    step(a), first turn:  key = (a.strip() == str(key_digit)); left -= 1     → door(c, key)
    step(a), at the door: left -= 1; opened = key and a.strip() == str(c)
                          reward = 1 if opened else 0;  done = opened or left == 0   → door(c, key)
    action_value(row, a) = Q*(start, a) = 1 if a is the key digit else 0    (the door can then be opened)

**Defaults**

- ``key = 2`` [INFERRED] the digit the model does not answer by default (above).
- ``slack = 0`` [INFERRED] two turns: one pick, one door try (design note: ``max_turns = 2``);
  ``slack`` adds door tries.
- codes 1..4 [INFERRED] the digits the model already writes after ``=``; the task has 400 rows
  (4 codes x 100 rooms, the room is not shown), the first ``TEST_SIZE`` are the test split.

**Notes**

1. ``outcome()`` = ``{"key": held the key, "opened": door opened, "turns": actions played}``;
   ``episodes`` logs their means as ``env/key`` (the sampled P(pick key)), ``env/opened``, ``env/turns``.
2. Held-out evaluation (one greedy action from the first observation, scored by ``action_value``)
   is the greedy first-move accuracy, P(pick key), the quantity of spec 23's behavioural test. The
   first observation is the same for every row, so it is 0 or 1 at each evaluation.
3. The seed of ``reset`` is unused: the game is deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cache

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.tasks import Task, register_task, split_pool

START = "pick 1-4="
CODES = (1, 2, 3, 4)
ROOMS = 100
TEST_SIZE = 40
_SPLIT_SEED = 2323


def door(code: int, key: bool) -> str:
    return f"door {code} key=" if key else f"door {code}="


@register("env", "keydoor")
@dataclass
class KeyDoor:
    """Pick the key (digit ``key``) on turn 1, then type the door code: reward 1 iff both (one episode an instance)."""

    key: int = 2
    slack: int = 0
    code: int = field(default=0, init=False)
    has_key: bool = field(default=False, init=False)
    opened: bool = field(default=False, init=False)
    played: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.key <= 9 or self.slack < 0:
            raise ConfigError(
                f"env keydoor: key must be one digit 0..9 and slack >= 0, got key={self.key}, slack={self.slack}"
            )

    def reset(self, row: dict, seed: int) -> str:
        self.code, self.has_key, self.opened, self.played = int(row["code"]), False, False, 0
        return START

    def step(self, action: str) -> tuple[str, float, bool]:
        text = action.strip() if isinstance(action, str) else ""
        self.played += 1
        if self.played == 1:  # the pick
            self.has_key = text == str(self.key)
            return door(self.code, self.has_key), 0.0, False
        self.opened = self.has_key and text == str(self.code)
        return door(self.code, self.has_key), float(self.opened), self.opened or self.played >= 2 + self.slack

    def outcome(self) -> dict:
        return {"key": self.has_key, "opened": self.opened, "turns": self.played}

    def action_value(self, row: dict, action: str) -> float:
        """Q*(start, action): 1 when the door can still be opened after this first action (it picked the key)."""
        return 1.0 if isinstance(action, str) and action.strip() == str(self.key) else 0.0


@cache
def _problems() -> tuple[tuple[int, int], ...]:
    pairs = [(c, r) for c in CODES for r in range(ROOMS)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return tuple(pairs)


def format_row(code: int, room: int, key: int = 2) -> dict:
    """``{"prompt": "pick 1-4=", "answer": "2 3", "env": "keydoor", "code": 3, "room": 17}``."""
    return {"prompt": START, "answer": f"{key} {code}", "env": "keydoor", "code": code, "room": room}


def _rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    return [format_row(c, r) for c, r in split_pool(list(_problems()), split, n, seed, TEST_SIZE, "keydoor")]


register_task(
    Task(
        "keydoor",
        "multi-turn: pick the key ('pick 1-4=' -> '2'), then type the door's code ('door 3 key=' -> '3'); "
        "reward env_return",
        _rows,
        reward="env_return",
    )
)
