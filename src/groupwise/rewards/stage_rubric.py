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

The LM judge (``judge = "role:NAME"``, a frozen role ``roles.NAME``) asks one yes/no question per
rubric item instead and takes the mean of its yes-confidences (DVReward's ``yes_no_confidence`` on the
judge's first answer token, ``rewards/dvreward.py``: ``ask_judge``)::

    q_i      = question.format(item = ref_i, stage = seg(x))           one per reference item
    c_i      = P(yes) / (P(yes) + P(no))   over the judge's top ``top_logprobs`` first tokens for
               template.format(question = q_i)   (``match``: "prefix" counts "y"/"n")
    s        = mean_i c_i                         0 when x has no such stage (nothing asked)

**Defaults**

- ``judge = "reference"`` [INFERRED] the rubric items are the pieces of the reference solution's
  stage (column ``column``), the spec's "programmatic rubrics per stage"; ``"role:NAME"`` is the LM
  judge above (the spec's judge; the rubric items are still the reference's pieces).
- LM judge only: ``question = "Is {item} in {stage}?"``, ``template = "{question} Answer yes or no:"``
  (DVReward's), ``top_logprobs = 5`` (DVReward's [CODE]), ``match = "prefix"`` [INFERRED] (the
  shipped ``judge`` model answers with a first token ``y``/``n``).
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
4. The spec's judge is an LM with stage-specific, evolving (self-generated) rubrics; here the rubric
   items are fixed (the reference's pieces) whichever judge scores them; self-generated, evolving
   rubrics are not built.
5. LM judge: every (row, item) question of one call goes to the judge as one no-grad batch; a
   question longer than the judge's context has its stage text shortened from the end until it fits.
   The role reaches the reward through ``use_models`` (``components.bind_models``); a ``role:`` judge
   without that frozen role is refused at build, and one never given its model (built outside a
   trainer) is a ``RewardError`` when called. The LM judge ignores extra pieces (it scores the items).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._common import get_column
from groupwise.rewards._judge import FrozenJudge, ask_judge
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
class StageRubric(FrozenJudge):
    """One stage of a tagged completion scored by the rubric items of the reference's same stage (RubricEM, spec 39)."""

    tags: list = field(default_factory=lambda: ["<p>", "</p>"])
    column: str = "answer"
    split: str = r"[\s+]+"
    judge: str = "reference"
    question: str = "Is {item} in {stage}?"
    template: str = "{question} Answer yes or no:"
    top_logprobs: int = 5
    match: str = "prefix"
    label: str = ""
    weight: float = 1.0
    _models: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_tags(self.tags, "reward stage_rubric: tags", need_open=True)
        self.check_judge("reference")
        if "{item}" not in self.question or "{stage}" not in self.question:
            raise ConfigError(f"reward stage_rubric: question={self.question!r} must contain {{item}} and {{stage}}")
        try:
            re.compile(self.split)
        except re.error as err:
            raise ConfigError(
                f"reward stage_rubric: split={self.split!r} is not a regular expression ({err})"
            ) from None
        if re.fullmatch(self.split, "") is not None:
            raise ConfigError(
                f"reward stage_rubric: split={self.split!r} matches the empty string; use e.g. '[\\\\s+]+'"
            )

    def _questions(self, stage: str, items: list[str]) -> list[str]:
        """The LM judge's question on each rubric item, the stage text shortened until it fits the judge (Notes 5)."""
        judge = self.judge_model()
        room = getattr(judge, "context", None)
        out = []
        for item in items:
            text = stage
            while True:
                q = self.question.format(item=item, stage=text)
                if not room or not text or len(judge.encode(self.template.format(question=q))) < room:
                    break
                text = text[:-1]
            out.append(q)
        return out

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        refs = get_column(columns, self.column, len(completions), "stage_rubric")
        out: list[float | None] = []
        asks: list[tuple[int, list[str]]] = []  # LM judge: (row, its questions)
        for text, ref in zip(completions, refs):
            ref_items = None if ref is None else stage_items(str(ref), self.tags, self.split)
            if not ref_items:
                out.append(None)
            elif self.role is None:
                out.append(rubric_score(stage_items(text, self.tags, self.split), ref_items))
            else:
                spans = tag_spans(text, self.tags)
                out.append(0.0)
                if spans:
                    asks.append((len(out) - 1, self._questions(text[spans[0][0] : spans[0][1]], ref_items)))
        if asks:
            conf = ask_judge(
                self.judge_model(),
                [q for _, qs in asks for q in qs],
                self.template,
                self.top_logprobs,
                False,
                self.match,
            )
            i = 0
            for row, qs in asks:
                out[row] = sum(conf[i : i + len(qs)]) / len(qs)
                i += len(qs)
        return out
