"""Synthetic retrieval and ranking: pick the relevant items from a pool, then order them.

The small-scale analogue of F-GRPO's generate-then-rank rollouts (specs/24). A pool of eight items
``A..H`` each shows one feature digit; a hidden rule (the larger the digit, the more relevant) makes
the ``K = 3`` largest the relevant set, with graded gains 3, 2, 1 in that order. Prompt::

    A3 B7 C1 D9 E4 F2 G8 H5:

The reference response (what an ``sft`` phase teaches) names the candidate set in pool order inside
``[...]`` (the generation phase), then ranks it (the ranking phase)::

    [B,D,G]D>G>B

Rows: ``{"prompt", "answer", "gains", "relevant", "pool"}`` — ``gains`` maps each relevant id to its
graded gain (``{"D": 3, "G": 2, "B": 1}``), ``relevant`` lists them best first. The default reward
is ``ndcg_at_k`` (``rewards/ranking.py``: NDCG@3 of the ranking), whose value is 1 only for the
ideal order.

**Change vs GRPO**: none; a verifiable task.

**Defaults** (all [INFERRED], sized for the embedded model's 128-token context)

- ``ITEMS = "ABCDEFGH"`` with distinct digits ``0..9``; ``K = 3`` relevant items, gains ``3, 2, 1``.
- ``TEST_SIZE = 300`` and ``TRAIN_SIZE = 8000`` rows.

**Notes**

1. Problems are drawn from fixed seeds; a train row whose prompt equals a test prompt is skipped,
   so the splits are disjoint whatever ``n`` and ``seed`` a caller asks for.
2. The feature digits are distinct, so the relevant set and its order are unique.
"""

from __future__ import annotations

import random
from functools import lru_cache

from groupwise.tasks import Task, register_task

ITEMS = "ABCDEFGH"
K = 3
TEST_SIZE = 300
TRAIN_SIZE = 8000
_SPLIT_SEED = 2424


def make_problem(rng: random.Random) -> dict:
    """One row (module docstring) drawn from ``rng``."""
    digits = rng.sample(range(10), len(ITEMS))
    score = dict(zip(ITEMS, digits))
    best = sorted(ITEMS, key=lambda item: -score[item])[:K]  # relevant ids, best first
    return {
        "prompt": " ".join(f"{item}{score[item]}" for item in ITEMS) + ":",
        "answer": "[" + ",".join(sorted(best)) + "]" + ">".join(best),
        "gains": {item: K - i for i, item in enumerate(best)},
        "relevant": best,
        "pool": list(ITEMS),
    }


@lru_cache(maxsize=1)
def _splits() -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    rng = random.Random(_SPLIT_SEED)
    test = [make_problem(rng) for _ in range(TEST_SIZE)]
    seen, train = {r["prompt"] for r in test}, []
    rng = random.Random(_SPLIT_SEED + 1)
    while len(train) < TRAIN_SIZE:
        row = make_problem(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            train.append(row)
    return tuple(test), tuple(train)


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    test, train = _splits()
    if split == "test":
        pool = list(test)
    elif split == "train":
        pool = list(train)
        if n > 0:
            random.Random(seed).shuffle(pool)
    else:
        raise ValueError(f"ranking has splits 'train' and 'test', not {split!r}")
    return [
        dict(r, gains=dict(r["gains"]), relevant=list(r["relevant"]), pool=list(r["pool"]))
        for r in (pool[:n] if n > 0 else pool)
    ]


register_task(
    Task(
        "ranking",
        "pick the 3 largest-digit items of an 8-item pool, then "
        "rank them: 'A3 B7 C1 D9 E4 F2 G8 H5:' -> '[B,D,G]D>G>B'",
        rows,
        reward="ndcg_at_k",
    )
)
