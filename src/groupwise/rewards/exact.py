"""Exact-match reward: 1.0 when the completion equals the gold answer, else 0.0.

Standard practice, no paper: the simplest verifiable reward, as in TinyZero-style arithmetic tasks
and the "exact match" scorers of lm-evaluation-harness
(https://github.com/EleutherAI/lm-evaluation-harness).

**Change vs GRPO**: none — a rule-based outcome reward; it only fills the reward column that
GRPO's advantage estimator then centres and scales. Nothing else in the loop changes.

**Math** (per completion ``text`` and the gold value ``gold`` of its row in ``column``)::

    score = None                                 if gold is None   (no verdict)
    score = 0.0                                  if start and start not in text
    text  = text.split(start, 1)[1]              if start          (what follows the first start string)
    text  = text.split(stop, 1)[0]               if stop           (cut at the first stop string)
    gold  = str(gold)
    text, gold = text.strip(), gold.strip()      if strip          (whitespace at both ends)
    score = 1.0 if text == gold else 0.0

**Defaults**

- ``column = "answer"`` [INFERRED] the column name our tasks and GSM8K use.
- ``strip = True`` [INFERRED] models end with a newline or space.
- ``stop = None`` (no cut) [INFERRED] nothing is cut unless asked.
- ``start = None`` (no cut) [INFERRED]; with ``start="<a>", stop="</a>"`` the reward compares the
  text of a tagged answer (``<p>…</p><r>…</r><a>12</a>`` → ``12``: the ``evidence`` task).
- ``weight = 1.0`` [CODE] TRL ``GRPOConfig.reward_weights = None`` weighs every reward 1.0.
- ``log_answer = False`` [INFERRED] nothing is logged unless asked.

**Notes**

1. A row whose gold value is ``None`` gets ``None`` (no verdict); the reward stage then excludes
   or zeroes it (``reward.missing``).
2. A missing column is an error that names the column (``RewardError`` from ``get_column``, which
   also rejects a column without one value per completion).
3. A non-string gold value is compared as ``str(value)``: ``42`` matches ``"42"``, but ``42.0``
   becomes ``"42.0"`` and does not match ``"42"``.
4. ``stop`` and ``start`` cut the completion only, never the gold, and only when they are non-empty
   strings (``stop=""`` cuts nothing). ``start`` is looked for first; ``stop`` is then looked for in
   what follows it.
5. Nothing else is normalised: the comparison is case-sensitive, and whitespace inside the strings
   counts.
6. ``log_answer = True`` logs each completion's compared ``text`` (after ``stop`` and ``strip``)
   through ``log_extra("final_answer", ...)``, so it lands in ``rollout.info[b][g]["extra"]
   ["final_answer"]`` for components that read a row's final answer (EDAS, ``advantages/edas.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from groupwise.registry import register
from groupwise.rewards._common import get_column


@register("reward", "exact")
@dataclass
class Exact:
    """1.0 if the completion (after ``start``, up to ``stop``, stripped) equals the gold ``column``, else 0.0."""

    column: str = "answer"
    strip: bool = True
    stop: str | None = None
    start: str | None = None
    weight: float = 1.0
    log_answer: bool = False  # log each compared text as info extra "final_answer" (Note 6)

    def accepts_kwarg(self, name: str) -> bool:
        return self.log_answer and name == "log_extra"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], log_extra: Any = None, **columns: Any
    ) -> list[float | None]:
        answers = get_column(columns, self.column, len(completions), "exact")
        scores: list[float | None] = []
        finals: list[str] = []
        for text, gold in zip(completions, answers):
            if self.start:
                if self.start not in text:
                    finals.append("")
                    scores.append(None if gold is None else 0.0)
                    continue
                text = text.split(self.start, 1)[1]
            if self.stop:
                text = text.split(self.stop, 1)[0]
            finals.append(text.strip() if self.strip else text)
            if gold is None:
                scores.append(None)
                continue
            gold = str(gold)
            if self.strip:
                text, gold = text.strip(), gold.strip()
            scores.append(1.0 if text == gold else 0.0)
        if self.log_answer and log_extra is not None:
            log_extra("final_answer", finals)
        return scores
