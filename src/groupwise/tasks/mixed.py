"""Mixed-difficulty addition: five buckets, from often solved to never solved, with a ``level`` column.

A task for curricula (CGPO, FG-ExPO's Gaussian sampling, ...): the embedded model was warm-started
on ``"a+b="`` with ``a, b`` in ``0..99``; the buckets are chosen so that it solves some prompts
often, some rarely and some never, and a sampler that learns which prompts carry signal has
something to find.

| level | name          | prompts                                   | problems |
|-------|---------------|-------------------------------------------|----------|
| 0     | ``one_digit`` | ``a+b=``, a, b in 0..9                    | 100      |
| 1     | ``no_carry``  | ``a+b=``, a, b in 10..99, units sum < 10  | 4,455    |
| 2     | ``carry``     | ``a+b=``, a, b in 10..99, units sum >= 10 | 3,645    |
| 3     | ``three_terms`` | ``a+b+c=``, a, b, c in 0..9 (never trained) | 1,000 |
| 4     | ``three_digit`` | ``a+b=``, a in 100..999, b in 10..99 (never trained) | 81,000 |

Measured on the embedded model (train rows, 8 samples at temperature 1 per prompt, 60 prompts of
level 0 and ~170 of each other level): pass@1 = 0.37 / 0.30 / 0.18 / 0.00 / 0.00 per level, greedy
0.47 / 0.48 / 0.26 / 0.00 / 0.00; 60 % of all train groups of 8 are all-equal (no GRPO signal), including
every group of levels 3 and 4 (never solved). Greedy accuracy on the test split: 0.23.

Splits: within each level a fixed, seeded shuffle of its problems puts the first
``TEST_PER_LEVEL`` in ``test`` and the next ``TRAIN_PER_LEVEL`` in ``train`` (``one_digit``: all the
rest, 60), so the splits are disjoint whatever ``n`` and ``seed`` a caller asks for. Both splits
interleave the levels (0, 1, 2, 3, 4, 0, 1, ...) so any prefix is balanced while every level lasts;
``n`` train rows are a ``seed``-shuffled sample of each level. The full train split has 1,660 rows
(48 % in the never-solved levels 3-4); the test split 200 (40 per level).

Rows: ``{"prompt", "answer", "level"}``; the default reward is ``exact``.
"""

from __future__ import annotations

import itertools
import random
from functools import cache

from groupwise.tasks import Task, register_task

LEVELS = ("one_digit", "no_carry", "carry", "three_terms", "three_digit")
TEST_PER_LEVEL = 40
TRAIN_PER_LEVEL = 400
_SPLIT_SEED = 5150


def _level_terms(level: int) -> list[tuple[int, ...]]:
    """Every problem of ``level`` as its tuple of terms, in a fixed order."""
    two = range(10, 100)
    if level == 0:
        return [(a, b) for a in range(10) for b in range(10)]
    if level == 1:
        return [(a, b) for a in two for b in two if a % 10 + b % 10 < 10]
    if level == 2:
        return [(a, b) for a in two for b in two if a % 10 + b % 10 >= 10]
    if level == 3:
        return list(itertools.product(range(10), repeat=3))
    if level == 4:
        return [(a, b) for a in range(100, 1000) for b in two]
    raise ValueError(f"mixed has levels 0..{len(LEVELS) - 1}, not {level!r}")


@cache
def _pools(level: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(test problems, train problems) of one level."""
    problems = _level_terms(level)
    random.Random(_SPLIT_SEED + level).shuffle(problems)
    test = problems[:TEST_PER_LEVEL]
    train = problems[TEST_PER_LEVEL : TEST_PER_LEVEL + TRAIN_PER_LEVEL]
    return tuple(test), tuple(train)


def format_row(terms: tuple[int, ...], level: int) -> dict:
    """One data row: ``{"prompt": "3+4+5=", "answer": "12", "level": 3}``."""
    return {"prompt": "+".join(str(t) for t in terms) + "=", "answer": str(sum(terms)), "level": level}


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    if split not in ("train", "test"):
        raise ValueError(f"mixed has splits 'train' and 'test', not {split!r}")
    pools = [list(_pools(level)[0 if split == "test" else 1]) for level in range(len(LEVELS))]
    if split == "train" and n > 0:
        rng = random.Random(seed)
        pools = [rng.sample(pool, len(pool)) for pool in pools]
    out = []
    for group in itertools.zip_longest(*pools):
        out.extend(format_row(terms, level) for level, terms in enumerate(group) if terms is not None)
    return out[:n] if n > 0 else out


register_task(
    Task(
        "mixed",
        "addition in 5 difficulty levels (one-digit .. three terms / three digits), 'level' column, exact-match reward",
        rows,
        reward="exact",
    )
)
