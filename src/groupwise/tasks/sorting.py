"""Sorting digits: ``"sort 5 2 9:"`` -> ``"2 5 9"``.

Every sequence of ``3..5`` digits (``0..9``, repeats allowed) is one problem. For each length, a
fixed, seeded permutation of all its sequences puts the first ``TEST_PER_LENGTH`` in the held-out
``test`` split and the rest in ``train``, so the splits are disjoint whatever ``n`` and ``seed`` a
caller asks for, and the test split has the same number of problems of every length.

Rows from both splits interleave the lengths (3, 4, 5, 3, 4, 5, ...) so that any prefix of
``n`` rows is balanced across lengths, although longer sequences are far more numerous
(10**5 of length 5 against 10**3 of length 3). ``n`` train rows are a ``seed``-shuffled sample;
the test split is always in its fixed order. Rows: ``{"prompt", "answer", "nums"}``; the default
reward is ``exact`` against ``answer``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from functools import cache

from groupwise.tasks import Task, register_task

LENGTHS = (3, 4, 5)
TEST_PER_LENGTH = 100
_SPLIT_SEED = 2024


@cache
def _problems(length: int) -> tuple[tuple[int, ...], ...]:
    """All digit sequences of ``length`` in split order (the first ``TEST_PER_LENGTH`` are test)."""
    seqs = list(itertools.product(range(10), repeat=length))
    random.Random(_SPLIT_SEED + length).shuffle(seqs)
    return tuple(seqs)


def format_row(nums: Sequence[int]) -> dict:
    """One data row: ``{"prompt": "sort 5 2 9:", "answer": "2 5 9", "nums": [5, 2, 9]}``."""
    return {
        "prompt": "sort " + " ".join(str(x) for x in nums) + ":",
        "answer": " ".join(str(x) for x in sorted(nums)),
        "nums": list(nums),
    }


def _interleave(pools: list[Sequence[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """Round-robin over the pools until all are exhausted."""
    out = []
    for group in itertools.zip_longest(*pools):
        out.extend(seq for seq in group if seq is not None)
    return out


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    if split == "test":
        pools = [_problems(length)[:TEST_PER_LENGTH] for length in LENGTHS]
    elif split == "train":
        pools = [_problems(length)[TEST_PER_LENGTH:] for length in LENGTHS]
        if n > 0:
            rng = random.Random(seed)
            pools = [rng.sample(pool, len(pool)) for pool in pools]
    else:
        raise ValueError(f"sorting has splits 'train' and 'test', not {split!r}")
    seqs = _interleave(pools)
    seqs = seqs[:n] if n > 0 else seqs
    return [format_row(seq) for seq in seqs]


register_task(
    Task("sorting", "sort 3-5 digits ascending: 'sort 5 2 9:' -> '2 5 9', exact-match reward", rows, reward="exact")
)
