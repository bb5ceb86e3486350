"""Sum pairs: write two numbers that add up to N — a task with many distinct correct answers.

Prompt ``"82="``; any completion ``"a+b"`` with non-negative integers a + b = 82 is correct
(``"37+45"``, ``"45+37"``, ``"0+82"``, ...): N + 1 ordered answers. The multi-solution toy of GCPO
(specs/35), where a policy can be right in many distinct ways or collapse onto one.

Problems: N in ``0..198`` (the sums of the embedded model's two-number addition, operands
``0..99``). A fixed seeded shuffle puts ``TEST_SIZE = 50`` values of N in the held-out split, the
rest in train, so no held-out N is ever trained on. Each train N appears ``PER_TARGET = 20`` times,
each row with its own seeded reference ``answer`` ``"a+b"`` (a uniform in ``max(0, N−99)..min(99, N)``,
so both operands are in 0..99): an ``sft`` phase on them teaches the format and a spread of
answers, not one answer per N. Rows: ``{"prompt", "answer", "target"}``; the default reward is
``sum_pair``.

**Change vs GRPO**: none; a verifiable task and its rule-based reward.

**Math** (reward of one completion; ``line`` = its first non-empty line, stripped)::

    r = 1   if line matches  DIGITS "+" DIGITS  (no sign, no leading zero but "0") and a + b == target
    r = 0   otherwise;   None when the row's target cannot be read (no verdict)

**Defaults** (all [INFERRED], the spec's small-scale analogue "several distinct valid solutions")

- N in 0..198, ``TEST_SIZE = 50`` held-out targets, ``PER_TARGET = 20`` train rows per target.
- ``weight = 1.0`` the reward as is.

**Notes**

1. Distinct answers are distinct texts: ``"37+45"`` and ``"45+37"`` are two solutions.
2. Operands above 99 are correct too (``"150+48"`` for 198); only the references keep to 0..99.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from groupwise.registry import register
from groupwise.rewards._common import get_column
from groupwise.tasks import Task, register_task

TOP = 198
TEST_SIZE = 50
PER_TARGET = 20
_SPLIT_SEED = 3535
_PAIR = re.compile(r"(0|[1-9][0-9]*)\+(0|[1-9][0-9]*)")


@lru_cache(maxsize=1)
def _targets() -> tuple[int, ...]:
    """Every target in split order (the first ``TEST_SIZE`` are test)."""
    targets = list(range(TOP + 1))
    random.Random(_SPLIT_SEED).shuffle(targets)
    return tuple(targets)


def format_row(target: int, rng: random.Random) -> dict:
    """``{"prompt": "82=", "answer": "37+45", "target": 82}`` with a seeded reference split of the target."""
    a = rng.randint(max(0, target - 99), min(99, target))
    return {"prompt": f"{target}=", "answer": f"{a}+{target - a}", "target": target}


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split. Test: one row per
    held-out target, fixed order; train: ``PER_TARGET`` rows per train target, ``seed``-shuffled."""
    targets = _targets()
    if split == "test":
        rng = random.Random(_SPLIT_SEED + 1)
        pool = [format_row(t, rng) for t in targets[:TEST_SIZE]]
    elif split == "train":
        rng = random.Random(_SPLIT_SEED + 2)
        pool = [format_row(t, rng) for t in targets[TEST_SIZE:] for _ in range(PER_TARGET)]
        random.Random(seed).shuffle(pool)
    else:
        raise ValueError(f"sum_pairs has splits 'train' and 'test', not {split!r}")
    return pool[:n] if n > 0 else pool


def check_pair(completion: str, target: int) -> float:
    """1.0 if the completion's first non-empty line is ``a+b`` with a + b == target, else 0.0."""
    line = next((ln.strip() for ln in str(completion).splitlines() if ln.strip()), "")
    match = _PAIR.fullmatch(line)
    return 1.0 if match and int(match[1]) + int(match[2]) == int(target) else 0.0


@register("reward", "sum_pair")
@dataclass
class SumPairReward:
    """1 when the completion is ``a+b`` with non-negative integers summing to the row's ``target``.

    Reads the ``target`` column; a row whose target is None or not an integer gets ``None`` (no verdict).
    """

    weight: float = 1.0

    def __call__(self, prompts: Sequence[str], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        targets = get_column(columns, "target", len(completions), "sum_pair")
        scores: list[float | None] = []
        for completion, target in zip(completions, targets, strict=True):
            try:
                scores.append(check_pair(completion if isinstance(completion, str) else str(completion), int(target)))
            except (TypeError, ValueError):
                scores.append(None)
        return scores


register_task(
    Task(
        "sum_pairs",
        "write two numbers that add up to N, any of N+1 answers: '82=' -> '37+45' (or '45+37', '0+82', ...)",
        rows,
        reward="sum_pair",
    )
)
