"""A stage rubric judge: one stage of a tagged completion scored against the rubric items of that stage.

Part of RubricEM ("RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable
Rewards", arXiv 2605.10899, spec 39; no code found, forms [INFERRED]). The stage-structured
advantage ``rubricem`` (``advantages/rubricem.py``) reads one such reward per stage from
``rollout.reward_parts``; listed alone (or several summed) it is an ordinary terminal reward.

**Change vs GRPO**: none to the algorithm; a dense, per-stage judge in place of one verifier.

**Math** (the programmatic judge, the spec's CPU analogue "plan mentions the right operations;
intermediate values correct; answer correct")::

    seg(x)   = the text of x's first segment between tags = [open, close]   (textspans.tag_spans)
    items(x) = seg(x) split on the separator regex ``split`` (empty pieces dropped)
    ref      = items(reference column), pred = items(completion)
    s        = #{i : pred_i == ref_i} / max(|ref|, |pred|)        ∈ [0, 1]   (mean of item scores)

A rubric item is one piece of the reference's stage, scored 1 when the completion's stage has the
same piece at the same place; extra pieces lower the score (the max in the denominator).

**Defaults**

- ``judge = "reference"`` [INFERRED] the rubric items are the pieces of the reference solution's
  stage (column ``column``), the spec's "programmatic rubrics per stage". A frozen-LM judge
  (``roles.NAME.frozen``) is NOT built: see Notes 4.
- ``column = "answer"`` [INFERRED] the reference solution column of the built-in tasks (``evidence``).
- ``tags = ["<p>", "</p>"]`` [INFERRED] the ``evidence`` task's first stage.
- ``split = "[\\s+]+"`` [INFERRED] whitespace and '+': ``a=3 d=1`` -> [a=3, d=1], ``3+1`` -> [3, 1].
- ``label = ""`` [INFERRED] the name the reward is logged under (``reward/<label>``); empty = the
  registry name, repeats numbered (``stage_rubric[1]``).
- ``weight = 1.0`` [CODE] TRL ``GRPOConfig.reward_weights = None`` weighs every reward 1.0.

**Notes**

1. A completion without the stage's open tag scores 0; one cut by the length limit inside the stage
   is scored on what it wrote (a segment runs to the end of the text, ``textspans``).
2. A row whose reference is ``None`` or has no such stage (no items) gets ``None`` (no verdict).
3. Only the first segment counts on both sides.
4. The spec's judge is an LM with stage-specific, evolving (self-generated) rubrics; this CPU
   analogue's rubric is fixed and programmatic. Scoring through a frozen LM role would need a
   prompt template and a verdict parser per stage and is left undone (report of spec 39).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from groupwise.registry import ConfigError, register
from groupwise.rewards._common import get_column
from groupwise.textspans import check_tags, tag_spans


def stage_items(text: str, tags: Sequence[str], split: str) -> list[str] | None:
    """The pieces of ``text``'s first ``tags`` segment, or None when it has none."""
    spans = tag_spans(text, tags)
    if not spans:
        return None
    begin, end = spans[0]
    return [piece for piece in re.split(split, text[begin:end]) if piece]


def rubric_score(pred: list[str] | None, ref: list[str]) -> float:
    """Mean item score: matching pieces at the same place over max(|ref|, |pred|); 0 without the stage."""
    if not pred:
        return 0.0
    return sum(p == r for p, r in zip(pred, ref)) / max(len(ref), len(pred))


@register("reward", "stage_rubric")
@dataclass
class StageRubric:
    """One stage of a tagged completion scored by the rubric items of the reference's same stage (RubricEM, spec 39)."""

    tags: list = field(default_factory=lambda: ["<p>", "</p>"])
    column: str = "answer"
    split: str = r"[\s+]+"
    judge: str = "reference"
    label: str = ""
    weight: float = 1.0

    def __post_init__(self) -> None:
        check_tags(self.tags, "reward stage_rubric: tags", need_open=True)
        if self.judge != "reference":
            raise ConfigError(f"reward stage_rubric: judge must be 'reference' (the programmatic judge; an LM judge is not built), got {self.judge!r}")
        try:
            re.compile(self.split)
        except re.error as err:
            raise ConfigError(f"reward stage_rubric: split={self.split!r} is not a regular expression ({err})") from None
        if re.fullmatch(self.split, "") is not None:
            raise ConfigError(f"reward stage_rubric: split={self.split!r} matches the empty string; use e.g. '[\\\\s+]+'")

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        refs = get_column(columns, self.column, len(completions), "stage_rubric")
        out: list[float | None] = []
        for text, ref in zip(completions, refs):
            ref_items = None if ref is None else stage_items(str(ref), self.tags, self.split)
            out.append(None if not ref_items else rubric_score(stage_items(text, self.tags, self.split), ref_items))
        return out
