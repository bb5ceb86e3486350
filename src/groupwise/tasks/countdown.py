"""Countdown: combine the given numbers with ``+ - *`` to reach a target.

Prompt ``"3 5 7 -> 22:"``; a correct completion is an expression such as ``"3*5+7"``.

Rule: every given number is used **exactly once** (as in the classic Countdown game and the
TinyZero recipe); a number that appears twice in the prompt may be used twice. Only the binary
operators ``+``, ``-``, ``*`` and parentheses are allowed: no division, no unary minus, no
concatenating digits into new numbers. ``check_countdown(..., use_all=False)`` relaxes the rule to
"at most once".

Problems: three numbers in ``1..9`` and a positive target. The problem set is enumerated once:
for every multiset of three numbers, every expression over them (each number once, every
operator pair, both bracketings) is evaluated; each distinct ``(numbers, target > 0)`` pair is one
problem, so every problem is solvable by construction. A fixed, seeded shuffle of that list puts
the first ``TEST_SIZE`` problems in the held-out ``test`` split and the rest in ``train``, so the
splits are disjoint whatever ``n`` and ``seed`` a caller asks for. Problems are identified by the
multiset of numbers, so ``3 5 7 -> 22`` and ``7 3 5 -> 22`` are the same problem and never end up
in different splits. For each problem the same seeded RNG fixes the order in which the numbers
are shown and which of its solutions is the reference ``answer``.

Rows: ``{"prompt", "answer", "nums", "target"}``; the default reward is ``countdown``
(:class:`CountdownReward`), which reads the ``nums`` and ``target`` columns.

**Change vs GRPO**: none; a verifiable task and its rule-based reward (the TinyZero Countdown
recipe's setting), scored like any other reward.

**Math** (reward of one completion, ``expr`` = its first non-empty line, an optional ``= N`` with
``N == target`` allowed at the end)::

    r = 1   if expr uses only + - * ( ) and the given numbers (each exactly once, or at most once
            with use_all=False) and its value == target
    r = 0   otherwise;   None when the row's nums/target cannot be read (no verdict)

**Defaults**

- ``use_all = True`` [CODE] TinyZero's countdown reward requires every number once.
- ``weight = 1.0`` [INFERRED] the reward as is.

**Notes**

1. Expressions are parsed with ``ast`` and evaluated by walking the tree, never with ``eval``:
   only integer literals, ``+ - *`` and parentheses are accepted.
2. The problem set is enumerated, so every problem has a solution (see above).
"""

from __future__ import annotations

import ast
import itertools
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from groupwise.registry import register
from groupwise.rewards._common import get_column
from groupwise.tasks import Task, register_task, split_pool

N_NUMBERS = 3
LOW, HIGH = 1, 9
TEST_SIZE = 300
_SPLIT_SEED = 4321
MAX_EXPRESSION_CHARS = 200  # longer "expressions" are rejected before parsing

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}
_ALLOWED_CHARS = re.compile(r"[0-9+\-*()\s]+")


# ---------------------------------------------------------------- problem generation
def _join(left: str, left_op: str | None, op: str, right: str, right_op: str | None) -> str:
    """Write ``left op right`` with only the parentheses that precedence requires.

    ``left_op``/``right_op`` are the top operators of the operands (None for a bare number).
    A left operand needs brackets when it binds more loosely (``(3+5)*7``); a right operand also
    when it binds equally under ``-`` (``9-(5-2)``).
    """
    if left_op is not None and _PRECEDENCE[left_op] < _PRECEDENCE[op]:
        left = f"({left})"
    if right_op is not None and (
        _PRECEDENCE[right_op] < _PRECEDENCE[op] or (op == "-" and _PRECEDENCE[right_op] == _PRECEDENCE[op])
    ):
        right = f"({right})"
    return f"{left}{op}{right}"


def _expressions(a: int, b: int, c: int) -> list[tuple[str, int]]:
    """All ``(text, value)`` expressions using ``a, b, c`` in this order, each exactly once."""
    out = []
    for op1, op2 in itertools.product(_OPS, repeat=2):
        # (a op1 b) op2 c
        inner = _OPS[op1](a, b)
        text = _join(_join(str(a), None, op1, str(b), None), op1, op2, str(c), None)
        out.append((text, _OPS[op2](inner, c)))
        # a op1 (b op2 c)
        inner = _OPS[op2](b, c)
        text = _join(str(a), None, op1, _join(str(b), None, op2, str(c), None), op2)
        out.append((text, _OPS[op1](a, inner)))
    return out


@lru_cache(maxsize=1)
def _problems() -> tuple[tuple[tuple[int, ...], int, str], ...]:
    """Every problem as ``(shown numbers, target, reference expression)``, in split order."""
    solutions: dict[tuple[tuple[int, ...], int], set[str]] = {}
    for multiset in itertools.combinations_with_replacement(range(LOW, HIGH + 1), N_NUMBERS):
        for order in set(itertools.permutations(multiset)):
            for text, value in _expressions(*order):
                if value > 0:
                    solutions.setdefault((multiset, value), set()).add(text)
    rng = random.Random(_SPLIT_SEED)
    keys = sorted(solutions)
    rng.shuffle(keys)
    problems = []
    for multiset, target in keys:
        shown = list(multiset)
        rng.shuffle(shown)
        reference = rng.choice(sorted(solutions[(multiset, target)]))
        problems.append((tuple(shown), target, reference))
    return tuple(problems)


def format_row(nums: Sequence[int], target: int, reference: str) -> dict:
    """One data row: ``{"prompt": "3 5 7 -> 22:", "answer": "3*5+7", "nums": [3, 5, 7], "target": 22}``."""
    return {
        "prompt": f"{' '.join(str(x) for x in nums)} -> {target}:",
        "answer": reference,
        "nums": list(nums),
        "target": target,
    }


def rows(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``split`` ('train' or 'test'); ``n <= 0`` means the whole split.

    The test split is always in its fixed order; ``n`` train rows are a ``seed``-shuffled sample.
    """
    pool = split_pool(_problems(), split, n, seed, TEST_SIZE, "countdown")
    return [format_row(nums, target, ref) for nums, target, ref in pool]


# ---------------------------------------------------------------- verification
def _answer_line(completion: str) -> str | None:
    """The completion's first non-empty line, stripped (None if there is none).

    The caller splits off and checks an optional trailing ``= N``.
    """
    for line in completion.splitlines():
        if line.strip():
            return line.strip()
    return None


def _evaluate(node: ast.AST, used: list[int]) -> int:
    """Evaluate a parsed expression of int literals and binary ``+ - *``; append literals to ``used``.

    Raises ValueError on any other node (names, calls, attributes, unary minus, ``/``, ``**``, ...).
    """
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
        left = _evaluate(node.left, used)
        right = _evaluate(node.right, used)
        return _OPS[_AST_OPS[type(node.op)]](left, right)
    raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")


def check_countdown(completion: str, nums: Sequence[int], target: int, *, use_all: bool = True) -> float:
    """1.0 if ``completion`` is a valid countdown solution for ``nums`` and ``target``, else 0.0.

    The expression is the completion's first non-empty line; an optional trailing ``= N`` is
    accepted when ``N`` equals the target (``"3*5+7 = 22"``). It may contain only integer literals,
    binary ``+ - *``, parentheses and spaces; it is parsed with :mod:`ast` and evaluated by walking
    the tree, never with ``eval``. Each literal must be one of ``nums`` (a number listed twice may
    be used twice); with ``use_all`` (default) every number must be used exactly once, otherwise at
    most once.
    """
    if not isinstance(completion, str):
        return 0.0
    line = _answer_line(completion)
    if line is None or len(line) > MAX_EXPRESSION_CHARS:
        return 0.0
    expr, eq, claimed = line.partition("=")
    if eq:
        claimed = claimed.strip().rstrip(".")
        if not claimed.isdigit() or int(claimed) != int(target):
            return 0.0
    expr = expr.strip()
    if not expr or not _ALLOWED_CHARS.fullmatch(expr):
        return 0.0
    try:
        tree = ast.parse(expr, mode="eval")
        used: list[int] = []
        value = _evaluate(tree, used)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0.0
    have, want = Counter(used), Counter(int(x) for x in nums)
    if use_all:
        ok_numbers = have == want
    else:
        ok_numbers = all(have[x] <= want[x] for x in have)
    return 1.0 if ok_numbers and value == int(target) else 0.0


def _as_nums(value: Any) -> list[int]:
    """``nums`` column value as a list of ints: a list/tuple of ints, or a string like ``"3 5 7"``."""
    if isinstance(value, str):
        return [int(x) for x in value.replace(",", " ").split()]
    return [int(x) for x in value]


def _completion_text(completion: Any) -> str:
    """Plain text of a completion, also for TRL's conversational form ``[{"role", "content"}, ...]``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


@register("reward", "countdown")
@dataclass
class CountdownReward:
    """Countdown verifier: 1 when the completion's expression uses the numbers and hits the target.

    Reads the ``nums`` and ``target`` columns; ``use_all`` requires every number exactly once
    (otherwise at most once). A row whose ``nums``/``target`` value is None or unreadable gets
    ``None`` (no verdict); a batch without those columns is an error naming them.
    """

    weight: float = 1.0
    use_all: bool = True

    def __call__(self, prompts: Sequence[str], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        all_nums = get_column(columns, "nums", len(completions), "countdown")
        targets = get_column(columns, "target", len(completions), "countdown")
        scores: list[float | None] = []
        for completion, nums, target in zip(completions, all_nums, targets, strict=True):
            try:
                nums_list, target_int = _as_nums(nums), int(target)
            except (TypeError, ValueError):
                scores.append(None)
                continue
            scores.append(check_countdown(_completion_text(completion), nums_list, target_int, use_all=self.use_all))
        return scores


register_task(
    Task(
        "countdown",
        "reach the target with + - * using each of 3 numbers (1..9) once: '3 5 7 -> 22:'",
        rows,
        reward="countdown",
    )
)
