"""The one reward both frameworks use: exact match on the addition answer.

TRL's reward-function signature ``f(prompts, completions, **columns) -> list[float]``; TRL passes the
dataset column ``answer`` (one value per completion) and extra keywords we ignore, groupwise calls it
through ``{name = "python", fn = "bench/rewards.py:exact_answer"}`` with the same columns. Completions
arrive as text with the EOS token already removed by both frameworks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def exact_answer(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any
) -> list[float]:
    """1.0 where the stripped completion equals the stripped answer, else 0.0."""
    scores = []
    for completion, gold in zip(completions, answer):
        if isinstance(completion, list):  # conversational form (not used here: no chat template)
            completion = completion[-1]["content"]
        scores.append(1.0 if str(completion).strip() == str(gold).strip() else 0.0)
    return scores
