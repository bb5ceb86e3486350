"""Operator selection: write the equation with the one operator that makes it true.

The functional-token toy of LA-GRPO (specs/18): a completion is a copy of the prompt's numbers with
one decisive operator token among them, and that token alone decides the reward::

    prompt:    13?7=91:
    reference: 13*7=91

The operator tokens ``+ - *`` are the task's functional tokens (single tokens of the embedded
model's vocabulary); the digits, ``=`` and EOS around them are filler the model copies. With the
embedded tokenizer every digit is a token, so a completion is 5-9 tokens with EOS, one of them an
operator. Rows: ``{"prompt", "answer", "nums", "target", "op"}``; the default reward is ``exact``
against ``answer`` (a problem has one true operator, see Notes).

**Change vs GRPO**: none; a verifiable task.

**Defaults** (all [INFERRED], the spec's "op token selects the arithmetic operation")

- Operands ``1..20``; operators ``+`` (every pair), ``*`` (every pair), ``-`` (a ≥ b, so the
  result is never negative and a ``-`` sign never appears outside the operator position).
- ``TEST_SIZE = 200`` problems held out (a fixed seeded shuffle of the whole problem list).

**Notes**

1. The only pair for which two operators give the same result is (2, 2): 2+2 = 2*2 = 4. It is left
   out, so every prompt has exactly one correct completion and ``exact`` is the right reward.
   (a + b = a − b needs b = 0; a − b = a·b has no solution with b ≥ 1.)
2. A problem is (a, b, operator); the split is by problem, so a held-out prompt is never trained on.
"""

from __future__ import annotations

import random
from functools import lru_cache

from groupwise.tasks import Task, register_task, split_pool

LOW, HIGH = 1, 20
OPS = ("+", "-", "*")
TEST_SIZE = 200
_SPLIT_SEED = 1818


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


@lru_cache(maxsize=1)
def _problems() -> tuple[tuple[int, str, int], ...]:
    """Every (a, op, b) in split order (the first ``TEST_SIZE`` are test)."""
    probs = [
        (a, op, b)
        for a in range(LOW, HIGH + 1)
        for b in range(LOW, HIGH + 1)
        for op in OPS
        if (a, b) != (2, 2) and not (op == "-" and a < b)
    ]
    random.Random(_SPLIT_SEED).shuffle(probs)
    return tuple(probs)


def format_row(a: int, op: str, b: int) -> dict:
    """``{"prompt": "13?7=91:", "answer": "13*7=91", "nums": [13, 7], "target": 91, "op": "*"}``."""
    c = _apply(a, op, b)
    return {"prompt": f"{a}?{b}={c}:", "answer": f"{a}{op}{b}={c}", "nums": [a, b], "target": c, "op": op}


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    return [format_row(*p) for p in split_pool(_problems(), split, n, seed, TEST_SIZE, "op_select")]


register_task(
    Task(
        "op_select",
        "write the equation with the operator that makes it true: '13?7=91:' -> '13*7=91' (functional tokens + - *)",
        rows,
    )
)
