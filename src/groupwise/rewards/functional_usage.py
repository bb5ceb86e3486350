"""Functional-token usage validity: 1.0 when a completion uses its functional tokens validly, else 0.0.

ATLAS / LA-GRPO, 2026, https://arxiv.org/abs/2605.15198 (spec: specs/18): GRPO with rewards for
answer correctness **and functional-token usage validity**, ``r = r_answer + λ_f · r_func``. The
validity rule is not published; this is the spec's reconstruction. The anchor loss is
``losses/la_grpo.py``.

**Change vs GRPO**: a rule-based reward added to the task's (``rewards = [TASK_REWARD,
{name = "functional_usage", weight = 0.5}]``); GRPO's estimator centres and scales the sum.

**Math** (``n`` = occurrences of the functional texts in the completion, ``used`` = the set of them)::

    r_func = 1.0   if min_count <= n <= max_count   and (column unset or used ⊆ row[column])
    r_func = 0.0   otherwise

**Defaults**

- ``tokens = ["+", "-", "*"]`` [INFERRED] the ``op_select`` toy's operators, as the ``la_grpo`` term.
- ``min_count = 1`` [INFERRED] the spec's "at least one used when required"; 0 when not required.
- ``max_count = None`` (no upper bound) [INFERRED]; the toy's recipe sets 1 (one operator).
- ``column = None`` [INFERRED]: any functional token is valid; a column name (the toy's ``op``) makes
  a row's valid tokens that column's value (one text or a list), e.g. the task's intended operation.
- ``weight = 0.5`` [INFERRED] the spec's λ_f.

**Notes**

1. Counting is on the completion text (the reward sees decoded text): non-overlapping occurrences of
   each functional text, longest first, so a text inside a longer functional text is not counted twice.
2. A row whose ``column`` value is missing (None) gets ``None`` (no verdict), never a silent 0.
3. ``label`` names the reward in logs (``reward/LABEL``) when one run scores two validity rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._common import get_column


def count_functional(text: str, tokens: Sequence[str]) -> tuple[int, set[str]]:
    """(number of non-overlapping functional occurrences, the set of texts used), longest texts first."""
    n, used = 0, set()
    for tok in sorted(tokens, key=len, reverse=True):
        k = text.count(tok)
        if k:
            n, used = n + k, used | {tok}
            text = text.replace(tok, "\0")
    return n, used


@register("reward", "functional_usage")
@dataclass
class FunctionalUsage:
    """1.0 when the completion's functional tokens are valid: their count in range (and each in the row's
    ``column``)."""

    tokens: list = field(default_factory=lambda: ["+", "-", "*"])
    min_count: int = 1
    max_count: int | None = None
    column: str | None = None
    weight: float = 0.5
    label: str = ""

    def __post_init__(self) -> None:
        if (
            not isinstance(self.tokens, (list, tuple))
            or not self.tokens
            or not all(isinstance(t, str) and t for t in self.tokens)
        ):
            raise ConfigError(
                f"reward functional_usage: tokens must be a non-empty list of non-empty texts, got {self.tokens!r}"
            )
        if not isinstance(self.min_count, int) or self.min_count < 0:
            raise ConfigError(f"reward functional_usage: min_count must be an int >= 0, got {self.min_count!r}")
        if self.max_count is not None and (
            not isinstance(self.max_count, int) or self.max_count < max(self.min_count, 1)
        ):
            raise ConfigError(
                "reward functional_usage: max_count must be None or "
                f"an int >= max(min_count, 1), got {self.max_count!r}"
            )

    def __call__(self, prompts: Sequence[str], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        allowed = (
            get_column(columns, self.column, len(completions), "functional_usage")
            if self.column
            else [None] * len(completions)
        )
        scores: list[float | None] = []
        for completion, ok in zip(completions, allowed, strict=True):
            n, used = count_functional(str(completion), self.tokens)
            if self.column and ok is None:
                scores.append(None)
                continue
            valid = self.min_count <= n and (self.max_count is None or n <= self.max_count)
            if self.column:
                valid = valid and used <= ({ok} if isinstance(ok, str) else set(ok))
            scores.append(1.0 if valid else 0.0)
        return scores
