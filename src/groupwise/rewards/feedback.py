"""Exact match with natural-language feedback: a verifier that says what was wrong (FBOS-RL's verifier).

"FBOS-RL: Feedback-Driven Bi-Objective Synergistic RL", arXiv 2605.20256 — spec 02: the rule-based
verifier returns a scalar reward **and** feedback text (error location, cause, format
violations); the feedback-augmented prompt of the ``fbos`` rollout strategy quotes it. Only the
abstract and a secondary digest were available; the feedback wording is ours.

**Change vs GRPO**: none to the reward (exact match, as ``exact``); each scored row also gets the
feedback text in ``rollout.info[b][g]["extra"]["feedback"]`` (through ``log_extra``), which a
rollout strategy may read between generation rounds.

**Math** (completion ``y`` stripped, gold answer ``a``)::

    reward   = 1 if y == a else 0
    feedback = ""                                                          if y == a
             = "the answer is not a number"                                 if y has no digits   (format)
             = "wrong: expected {len(a)} digits, the last one is {a[-1]}"   mode = "hint"   (spec's example)
             = "wrong: the answer is {a}"                                   mode = "answer"
             = "wrong"                                                      mode = "verdict"
             = a                                                            mode = "reference" (the answer itself)

**Defaults**

- ``mode = "hint"`` [INFERRED] spec 02's example feedback ("wrong: expected last digit 7");
  the paper's wording is not known.
- ``column = "answer"``, ``weight = 1.0`` as ``exact``.

- ``mode = "reference"`` [INFERRED] for the toy's ``hinted`` model, which was trained to read a
  "Reference solution: {answer}" line (``models/README.md``): feedback that gives the answer away.

**Notes**

1. A row without a gold answer gets ``None`` (no verdict) and empty feedback.
2. The feedback goes to ``samples.jsonl`` like any ``log_extra`` column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._common import get_column

MODES = ("hint", "answer", "verdict", "reference")


def feedback_text(text: str, gold: str, mode: str) -> str:
    """The verifier's feedback on one completion (empty when it is right)."""
    text, gold = text.strip(), gold.strip()
    if text == gold:
        return ""
    if mode == "reference":  # the strongest feedback: the answer itself, as a hint-reading model expects it
        return gold
    if not any(c.isdigit() for c in text):
        return "the answer is not a number"
    if mode == "answer":
        return f"wrong: the answer is {gold}"
    if mode == "hint":
        return f"wrong: expected {len(gold)} digits, the last one is {gold[-1:]}"
    return "wrong"


@register("reward", "exact_feedback")
@dataclass
class ExactFeedback:
    """Exact match (1/0) plus feedback text per row in ``info["extra"]["feedback"]`` (FBOS-RL's verifier)."""

    mode: str = "hint"
    column: str = "answer"
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"reward exact_feedback: mode={self.mode!r}; modes: {', '.join(MODES)}")

    def accepts_kwarg(self, name: str) -> bool:
        return name == "log_extra"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], log_extra: Any = None, **columns: Any
    ) -> list[float | None]:
        answers = get_column(columns, self.column, len(completions), "exact_feedback")
        scores: list[float | None] = []
        notes: list[str] = []
        for text, gold in zip(completions, answers):
            scores.append(None if gold is None else float(text.strip() == str(gold).strip()))
            notes.append("" if gold is None else feedback_text(text, str(gold), self.mode))
        if log_extra is not None:
            log_extra("feedback", notes)
        return scores
