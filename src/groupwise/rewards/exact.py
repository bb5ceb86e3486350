"""Exact-match reward: 1.0 when the completion equals the gold answer, else 0.0.

The simplest verifiable reward, as in TinyZero-style arithmetic tasks and the "exact match"
scorers of lm-evaluation-harness (https://github.com/EleutherAI/lm-evaluation-harness). The
completion is cut at the first ``stop`` string (if given), both sides are whitespace-stripped
(``strip=True``) and compared as strings; a non-string gold value is compared as ``str(value)``.

Defaults: ``column="answer"`` (the column name our tasks and GSM8K use) [INFERRED];
``strip=True`` [INFERRED: models end with a newline or space]; ``stop=None`` (no cut);
``weight=1.0``.

A row whose gold value is ``None`` gets ``None`` (no verdict). A missing column is an error that
names the column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from groupwise.registry import register
from groupwise.rewards._common import get_column


@register("reward", "exact")
@dataclass
class Exact:
    """1.0 if the completion (up to ``stop``, stripped) equals the gold ``column``, else 0.0."""

    column: str = "answer"
    strip: bool = True
    stop: str | None = None
    weight: float = 1.0

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        answers = get_column(columns, self.column, len(completions), "exact")
        scores: list[float | None] = []
        for text, gold in zip(completions, answers):
            if gold is None:
                scores.append(None)
                continue
            if self.stop:
                text = text.split(self.stop, 1)[0]
            gold = str(gold)
            if self.strip:
                text, gold = text.strip(), gold.strip()
            scores.append(1.0 if text == gold else 0.0)
        return scores
