"""Number words: ``"37 in words="`` -> ``"thirty-seven"`` (0..99), a small free-text task.

The toy "low-resource" task B of spec 20's behavioural test (semantic-reward GRPO): the embedded
model was warm-started on addition (``"a+b="`` -> digits, the dominant task A and its "script"),
and here it must answer the same kind of prompt in English words, a reference it can approach
piece by piece (``"thirty-eight"`` is close to ``"thirty-seven"`` in a sentence-embedding space,
``"37"`` less so, ``"five"`` not at all), which is what the ``semantic`` reward scores.

Every number 0..99 is one problem; a fixed, seeded permutation puts the first ``TEST_SIZE`` (30)
in the held-out split and the other 70 in train, so the splits are disjoint whatever ``n`` and
``seed`` a caller asks for. Words follow the usual US spelling with a hyphen between tens and
units (``"forty-two"``, ``"nineteen"``, ``"zero"``). Rows: ``{"prompt", "answer", "digits"}``
(``digits``: the number as digits); the default reward is ``exact`` (held-out accuracy).
"""

from __future__ import annotations

import random

from groupwise.tasks import Task, register_task, split_pool

TEST_SIZE = 30
_SPLIT_SEED = 2020
UNITS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
)
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def words(n: int) -> str:
    """``n`` (0..99) in English words: ``42`` -> ``"forty-two"``."""
    if not 0 <= n <= 99:
        raise ValueError(f"number_words spells 0..99, not {n}")
    if n < 20:
        return UNITS[n]
    tens, units = divmod(n, 10)
    return TENS[tens] + (f"-{UNITS[units]}" if units else "")


def format_row(n: int) -> dict:
    return {"prompt": f"{n} in words=", "answer": words(n), "digits": str(n)}


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    numbers = list(range(100))
    random.Random(_SPLIT_SEED).shuffle(numbers)
    return [format_row(k) for k in split_pool(numbers, split, n, seed, TEST_SIZE, "number_words")]


register_task(
    Task(
        "number_words",
        "a number 0..99 in English words ('37 in words=' -> 'thirty-seven'), 70 train / 30 test, exact-match reward",
        rows,
        reward="exact",
    )
)
