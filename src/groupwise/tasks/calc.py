"""Arithmetic beyond the embedded model's head, for an agent with a calculator tool.

**Change vs GRPO**: none by itself — the built-in agent task (``rollout = "agent"``,
``rollout/agent.py``): a product of two 3-digit numbers, which the ~0.8 M-parameter chat model cannot
compute in its head (the embedded model gets 2-digit *additions* right 29 % of the time,
``models/README.md``) but can answer by calling the ``calculator`` tool and copying its result.

**Rows** ``{"prompt": "482*739=", "expression": "482*739", "answer": "356198", "env": "answer"}``:
the env ``answer`` (``rollout/agent.py``) gives the prompt as the user message and rewards 1 when the
assistant's final reply (a turn without tool calls) is the answer.

**Defaults**

- operands ``100..999`` [INFERRED] six-digit products, far beyond mental arithmetic for this model.
- ``TEST_SIZE = 200`` [INFERRED] a fixed seeded permutation of all pairs puts the first 200 in ``test``.
"""

from __future__ import annotations

import random
from functools import cache

from groupwise.tasks import Task, register_task, split_pool

TEST_SIZE = 200
_SPLIT_SEED = 4040
_POOL = 20_000  # pairs drawn once (810,000 exist): train draws from the rest after the test slice


def format_row(a: int, b: int) -> dict:
    return {"prompt": f"{a}*{b}=", "expression": f"{a}*{b}", "answer": str(a * b), "env": "answer"}


@cache
def _pairs() -> tuple[tuple[int, int], ...]:
    rng = random.Random(_SPLIT_SEED)
    seen: dict[tuple[int, int], None] = {}
    while len(seen) < _POOL:
        seen[(rng.randint(100, 999), rng.randint(100, 999))] = None
    return tuple(seen)


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    return [format_row(a, b) for a, b in split_pool(list(_pairs()), split, n, seed, TEST_SIZE, "calc")]


register_task(
    Task(
        "calc",
        "agent task: a product of two 3-digit numbers ('482*739=' -> '356198'), answered with the calculator tool; "
        "rollout 'agent', reward env_return",
        rows,
        reward="env_return",
    )
)
