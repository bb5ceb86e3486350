"""Number attributes: ``"number even >50="`` -> any two-digit number with every asked attribute ("52").

The text toy of spec 27 (AlphaGRPO's DVReward): each prompt asks for a number with a set of
attributes — parity (``even``/``odd``), magnitude (``>50``/``<50``), ``ends5``, ``div3`` — which the
``dv_reward`` decomposer turns into one atomic yes/no question each ("Is 52 even?"), plus generic
quality questions ("Is 52 a two-digit number?"). The completion is free: many numbers are right.

Every consistent, non-empty attribute set is one problem (29: a set asking for ``even`` and
``ends5`` has no answer and is left out); a fixed, seeded permutation puts the first ``TEST_SIZE``
(9) in the held-out split and the other 20 in train. Rows: ``{"prompt", "attrs", "answer"}``
(``attrs`` the comma-separated keys of ``rewards.dvreward.ATTRIBUTES``; ``answer`` the smallest
two-digit number with all of them, an example only). The default reward (and so the held-out
accuracy) is ``dv_reward`` with its programmatic judge and ``method = "holistic"``: 1 exactly when the
completion is a two-digit number with every asked attribute, else 0.
"""

from __future__ import annotations

import itertools
import random

from groupwise.rewards.dvreward import ATTRIBUTES
from groupwise.tasks import Task, register_task, split_pool

TEST_SIZE = 9
_SPLIT_SEED = 2027
_AXES = (("", "even", "odd"), ("", "gt50", "lt50"), ("", "ends5"), ("", "div3"))


def satisfies(n: int, keys: list[str]) -> bool:
    return all(ATTRIBUTES[k][2](n) > 0 for k in keys)


def problems() -> list[list[str]]:
    """Every non-empty attribute set some two-digit number satisfies, in a fixed order."""
    out = []
    for combo in itertools.product(*_AXES):
        keys = [k for k in combo if k]
        if keys and any(satisfies(n, keys) for n in range(10, 100)):
            out.append(keys)
    return out


def format_row(keys: list[str]) -> dict:
    labels = " ".join(ATTRIBUTES[k][0] for k in keys)
    return {
        "prompt": f"number {labels}=",
        "attrs": ",".join(keys),
        "answer": str(next(n for n in range(10, 100) if satisfies(n, keys))),
    }


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split."""
    pool = problems()
    random.Random(_SPLIT_SEED).shuffle(pool)
    return [format_row(k) for k in split_pool(pool, split, n, seed, TEST_SIZE, "number_attrs")]


register_task(
    Task(
        "number_attrs",
        "a two-digit number with the asked attributes ('number even >50=' -> '52'), 20 train / 9 test, "
        "dv_reward (programmatic judge, holistic: every attribute)",
        rows,
        reward={"name": "dv_reward", "method": "holistic"},
    )
)
