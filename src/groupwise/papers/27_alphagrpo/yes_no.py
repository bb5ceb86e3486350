"""Yes/no questions about a number: ``"Is 52 even? Answer yes or no:"`` -> ``"yes"``.

The programmatic labels the shipped ``judge`` model (``models/judge``, spec 27) was fine-tuned on,
so that a tiny causal LM can serve as DVReward's frozen judge role: every question template of
``rewards.dvreward`` (``ATTRIBUTES`` and ``QUALITY``), in the reward's default judge prompt
(``"{question} Answer yes or no:"``), asked of every number 0..99 and of 100 three-digit numbers
(a fixed, seeded draw from 100..999, the same for every template: a policy asked for two digits
often writes three) — 1,600 problems. A fixed, seeded permutation puts the first ``TEST_SIZE``
(320) in the held-out split and the other 1,280 in train.
Rows: ``{"prompt", "answer", "question"}``; the answer is the programmatic truth (the attribute's
margin > 0), and the default reward is ``exact``.
"""

from __future__ import annotations

import random

from groupwise.rewards.dvreward import ATTRIBUTES, QUALITY
from groupwise.tasks import Task, register_task, split_pool

TEST_SIZE = 320
_SPLIT_SEED = 2728
TEMPLATE = "{question} Answer yes or no:"


def problems() -> list[tuple[str, bool]]:
    """(question, truth) for every template and number (0..99 and 100 drawn from 100..999), in a fixed order."""
    templates = [(q, m) for _, q, m in ATTRIBUTES.values()] + list(QUALITY.values())
    numbers = list(range(100)) + sorted(random.Random(_SPLIT_SEED).sample(range(100, 1000), 100))
    return [(q.format(n=n), m(n) > 0) for q, m in templates for n in numbers]


def format_row(problem: tuple[str, bool]) -> dict:
    question, truth = problem
    return {"prompt": TEMPLATE.format(question=question), "answer": "yes" if truth else "no", "question": question}


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    pool = problems()
    random.Random(_SPLIT_SEED).shuffle(pool)
    return [format_row(p) for p in split_pool(pool, split, n, seed, TEST_SIZE, "yes_no")]


register_task(
    Task(
        "yes_no",
        "yes/no questions about a number ('Is 52 even? Answer yes or no:' -> 'yes'), 1280 train / 320 test, "
        "exact-match reward (the judge model's fine-tuning labels)",
        rows,
        reward="exact",
    )
)
