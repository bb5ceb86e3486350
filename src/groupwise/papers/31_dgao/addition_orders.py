"""Two-number addition with permutable operands: ``"37+45="`` and ``"45+37="`` are one problem.

The order-sensitivity toy of DGAO (specs/31): the input elements are the operands, and every order
of them asks the same question with the same answer. The embedded model (fine-tuned on ``a+b=``
rows, both orders alike) is strongly order-sensitive: on 300 held-out pairs its greedy answers to
``a+b=`` and ``b+a=`` agree only 52 % of the time (accuracy 28 % and 31 %).

Rows carry what a strategy needs to rebuild the prompt in another order (``rollout/dgao.py``):
``elements`` (the operands as shown) and ``template`` (``"{elements}="``; the strategy joins the
elements with ``sep = "+"``). Rows: ``{"prompt", "answer", "elements", "template"}``; the default
reward is ``exact``.

**Change vs GRPO**: none; a verifiable task.

**Defaults** (all [INFERRED])

- Operands ``0..99`` (the demo task's range); a problem is an unordered pair ``{a, b}``, shown in a
  seeded random order; ``TEST_SIZE = 300`` pairs held out.

**Notes**

1. The split is by unordered pair, so no order of a held-out problem is ever trained on.
2. Pairs with ``a = b`` have one order only; they stay in the task (their groups are trivially consistent).
"""

from __future__ import annotations

import random
from functools import lru_cache

from groupwise.rollout.dgao import SLOT
from groupwise.tasks import Task, register_task, split_pool

TOP = 100
TEST_SIZE = 300
_SPLIT_SEED = 3131
TEMPLATE = SLOT + "="


@lru_cache(maxsize=1)
def _pairs() -> tuple[tuple[int, int], ...]:
    """Every unordered pair in split order (the first ``TEST_SIZE`` are test), each in a shown order."""
    rng = random.Random(_SPLIT_SEED)
    pairs = [(a, b) for a in range(TOP) for b in range(a, TOP)]
    rng.shuffle(pairs)
    return tuple((a, b) if rng.random() < 0.5 else (b, a) for a, b in pairs)


def format_row(a: int, b: int) -> dict:
    """``{"prompt": "37+45=", "answer": "82", "elements": ["37", "45"], "template": "{elements}="}``."""
    return {"prompt": f"{a}+{b}=", "answer": str(a + b), "elements": [str(a), str(b)], "template": TEMPLATE}


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    return [format_row(a, b) for a, b in split_pool(_pairs(), split, n, seed, TEST_SIZE, "addition_orders")]


register_task(
    Task(
        "addition_orders",
        "two-number addition whose operands may come in any order: '37+45=' -> '82' (rows carry elements/template)",
        rows,
    )
)
