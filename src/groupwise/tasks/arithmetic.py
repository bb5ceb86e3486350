"""Two-number addition: ``"37+45="`` -> ``"82"``.

Every pair ``(a, b)`` with ``0 <= a, b < 10**digits`` is one problem; a fixed, seeded permutation
puts the first ``test_size`` in the held-out split and the rest in train, so the splits are
disjoint whatever ``n`` and ``seed`` a caller asks for.
"""

from __future__ import annotations

import random

from groupwise.tasks import Task, register_task

DIGITS = 2
TEST_SIZE = 500
_SPLIT_SEED = 1234


def _problems(digits: int = DIGITS) -> list[tuple[int, int]]:
    top = 10**digits
    pairs = [(a, b) for a in range(top) for b in range(top)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return pairs


def format_row(a: int, b: int) -> dict:
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    pairs = _problems()
    if split == "test":
        pool = pairs[:TEST_SIZE]
    elif split == "train":
        pool = pairs[TEST_SIZE:]
    else:
        raise ValueError(f"arithmetic has splits 'train' and 'test', not {split!r}")
    if split == "train" and n > 0:
        pool = list(pool)
        random.Random(seed).shuffle(pool)
    pool = pool[:n] if n > 0 else pool
    return [format_row(a, b) for a, b in pool]


register_task(Task("arithmetic", "two-number addition 'a+b=' (0..99), exact-match reward", rows, reward="exact"))
