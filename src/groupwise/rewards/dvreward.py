"""DVReward: a decompositional verifiable reward — a judge answers atomic yes/no questions about
the completion, and their yes-confidences are pooled into one score (AlphaGRPO's reward).

"AlphaGRPO: GRPO over a unified AR+diffusion model with decompositional verifiable reward",
Huang, Wu, Yang, Liu, Zhao (ICML 2026), https://arxiv.org/abs/2605.12495 — spec 27 (formulas from
the authors' ``decompositional_verifiable_reward``, read for the spec; this code is our own).

**Change vs GRPO**

- The reward is no single verifier call: each prompt is decomposed into *semantic* questions (one
  per requested attribute) and *quality* questions (generic well-formedness), a frozen judge LM is
  asked each one ("Is 37 even? Answer yes or no:"), and the first answer token's top log-probs give
  a soft verdict ``c_q``; the verdicts are pooled (geometric mean of the semantic and quality means
  by default).
- Here the paper's image + MLLM judge becomes two toys: the text task ``number_attrs`` asks for a
  number with attributes ("number even >50="), the flow task ``flow_attrs`` for a 2-D sample in a
  quadrant and a radius band (the spec's "image" analogue, decoded ``"x,y"``). The decomposer is a
  template table per ``domain`` (``rewards.dv_questions``: ``"number"``, ``"point2d"``); the paper's
  offline LLM decomposer is not reproduced. The reward is the same text scorer for both
  modalities: it reads the decoded completion and the row's ``attrs``, asks the domain's questions,
  and the judge answers ``(question, margin)`` pairs whatever the sample is.

**Math** (per completion ``y``; ``lp`` the judge's first-token top log-probs, token text → log-prob)::

    norm(s)      = s.lower() with whitespace and punctuation stripped
    P(yes)       = Σ_{tok: norm(tok) = "yes"} exp(lp[tok])         P(no) likewise
                   (match = "prefix": norm(tok) a non-empty prefix of "yes" and not of "no")
    c_q          = P(yes) / (P(yes) + P(no))        if P(yes) + P(no) > 0
                 = 1[norm(answer) = "yes"]          otherwise (the judge's answer text; the argmax token for an LM role)
    c_q          = 1[norm(answer) = "yes"]          binary = true
    SC           = mean_{q ∈ sem} c_q    (1.0 when there is none)      PQ = mean_{q ∈ qual} c_q  (likewise)
    R            = sqrt(SC · PQ)          method = "geometric"
                 = 0.5 SC + 0.5 PQ        method = "mean"
                 = mean_{q ∈ sem ∪ qual} c_q  method = "sum_mean"
                 = 1[every c_q ≥ 0.5]     method = "holistic"  ([INFERRED] the claim's baseline: one verdict)
    score        = R                      (then × weight in the reward stage)

Judges (``judge``):

- ``"role:NAME"``: the frozen role ``roles.NAME`` (``frozen = true``), scored through the policy
  protocol (``Policy.scoring_models`` / ``Policy.score``, quantity ``logprobs``): each question is a
  one-token rollout whose prompt is the question, so ``logprobs[..., 0, :]`` is the judge's next-token
  distribution after it; its ``top_logprobs`` largest entries, keyed by ``Policy.token_texts``, are
  ``lp``, and the argmax token's text is the answer. The role reaches the reward through the
  ``use_models`` contract (``components.bind_models``).
- ``"programmatic"`` [INFERRED] (spec's CPU analogue): a soft classifier ``P(yes) = sigmoid(k · m)``
  where ``m`` is the attribute's signed margin (``margin``), written as the top log-probs
  ``{"yes": log P, "no": log(1 − P)}`` and the answer ``"yes"``/``"no"``, so it goes through the same
  ``yes_no_confidence`` as an LM judge.

**Defaults**

- ``method = "geometric"`` [CODE] the authors' default overall score.
- ``top_logprobs = 5`` [CODE] the judge call's ``top_logprobs=5``; ``binary = false`` [CODE].
- ``match = "word"`` [CODE] a token counts when it normalises to the word itself; ``"prefix"``
  [INFERRED] also counts a non-empty prefix of one word only (``"y"``, ``"ye"`` -> yes; ``"n"`` -> no),
  for a tokenizer without a whole-word ``yes`` token (the embedded byte-level BPE writes ``y e s``).
- ``template = "{question} Answer yes or no:"`` [INFERRED] the paper's system prompt ("strict
  auditor, answer only 'yes'/'no'") folded into the question for a model without a chat template.
- ``judge = "programmatic"`` [INFERRED] the embedded model answers addition, not yes/no questions
  (measured: see ``papers/27_alphagrpo/README.md``); ``"role:judge"`` uses a frozen LM role.
- ``k = 4.0`` [INFERRED] the programmatic judge's sharpness (P(yes) = 0.982 at margin 1).
- ``column = "attrs"`` [INFERRED] the task's comma-separated attribute keys.
- ``domain = "number"`` [INFERRED] the text toy's questions; ``"point2d"`` for flow samples.

**Notes**

1. ``yes_no_confidence`` takes a dict or a list of ``(token text, log-prob)`` pairs; several tokens
   may normalise to the same word (" yes", "Yes") and are summed. A NaN or -inf log-prob adds 0.
2. A row whose ``attrs`` is ``None`` gets ``None`` (no verdict). An unknown attribute key is a
   ``RewardError`` naming the key and the known ones.
3. A completion the domain cannot parse (no integer, no ``"x,y"`` point) still gets its questions
   asked; the programmatic judge answers "no" with margin −1 to every semantic and quality question
   about it.
4. ``_components(completions, attrs)`` returns per row ``(sem, qual)`` confidence lists; the reward
   logs the batch means of ``SC``, ``PQ`` and the share of satisfied attributes (``dv_sat``: the
   programmatic truth, whatever the judge) through ``log_metric``.
5. The LM judge runs once per call on every (row, question) as one no-grad batch of ``N`` one-token
   rows (``G = 1``); without ``use_models`` (a reward built outside a trainer) a ``role:`` judge is an
   error naming ``roles.NAME.frozen``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._common import get_column
from groupwise.rewards._judge import (
    FrozenJudge,
    ask_judge,
    verdict_word,  # noqa: F401  (re-exported)
    yes_no_confidence,
)
from groupwise.rewards.dv_questions import ATTRIBUTES, DOMAINS, QUALITY, as_int, as_point  # noqa: F401  (re-exported)

METHODS = ("geometric", "mean", "sum_mean", "holistic")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 1.0


def sc_pq(question_scores_sem: Sequence[float], question_scores_qual: Sequence[float]) -> tuple[float, float]:
    """(SC, PQ): the means of the semantic and of the quality verdicts, 1.0 for an empty list."""
    return _mean([float(c) for c in question_scores_sem]), _mean([float(c) for c in question_scores_qual])


def dv_reward(
    question_scores_sem: Sequence[float], question_scores_qual: Sequence[float], method: str = "geometric"
) -> float:
    """Pool the semantic and quality verdicts: SC, PQ and the overall score of ``method``."""
    if method not in METHODS:
        raise ValueError(f"dv_reward: method={method!r}; methods: {', '.join(METHODS)}")
    sem, qual = [float(c) for c in question_scores_sem], [float(c) for c in question_scores_qual]
    sc, pq = sc_pq(sem, qual)
    if method == "geometric":
        return math.sqrt(sc * pq)
    if method == "mean":
        return 0.5 * sc + 0.5 * pq
    if method == "sum_mean":
        return _mean(sem + qual)
    return float(all(c >= 0.5 for c in sem + qual))


def parse_attrs(value: Any, domain: str = "number") -> list[str]:
    """The attribute keys of a row (``"even,gt50"`` or a list), each checked against the domain's table."""
    return DOMAINS[domain].keys(value)


def decompose(
    completion: str, keys: Sequence[str], domain: str = "number"
) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Template decomposer: ([(semantic question, margin)], [(quality question, margin)]) about ``completion``
    (``rewards.dv_questions``); the margin is the programmatic truth (> 0: yes),
    −1 when the completion does not parse."""
    return DOMAINS[domain].decompose(completion, keys)


@register("reward", "dv_reward")
@dataclass
class DVReward(FrozenJudge):
    """Decompositional verifiable reward: judge yes-confidences on atomic questions, pooled (AlphaGRPO, spec 27)."""

    method: str = "geometric"
    judge: str = "programmatic"
    template: str = "{question} Answer yes or no:"
    top_logprobs: int = 5
    binary: bool = False
    match: str = "word"
    k: float = 4.0
    column: str = "attrs"
    domain: str = "number"
    weight: float = 1.0
    _models: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"reward 'dv_reward': method={self.method!r}; use one of {', '.join(METHODS)}")
        self.check_judge("programmatic")
        if self.domain not in DOMAINS:
            raise ConfigError(
                f"reward 'dv_reward': domain={self.domain!r}; use one of {', '.join(DOMAINS)} (rewards.dv_questions)"
            )
        if not self.k > 0:
            raise ConfigError(f"reward 'dv_reward': k={self.k} must be > 0 (the programmatic judge's sharpness)")

    # ------------------------------------------------------------------ judges
    def _ask_programmatic(self, margins: Sequence[float]) -> list[float]:
        out = []
        for m in margins:
            x = self.k * m
            p = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))  # stable for any margin
            lp = {"yes": math.log(p) if p > 0 else -math.inf, "no": math.log1p(-p) if p < 1 else -math.inf}
            out.append(yes_no_confidence(lp, "yes" if p >= 0.5 else "no", self.binary))
        return out

    def _ask_lm(self, questions: Sequence[str]) -> list[float]:
        """The frozen judge role's verdicts on ``questions`` through the policy protocol (Note 5)."""
        return ask_judge(self.judge_model(), questions, self.template, self.top_logprobs, self.binary, self.match)

    # ------------------------------------------------------------------ the reward
    def _components(
        self, completions: Sequence[str], attrs: Sequence[Any]
    ) -> list[tuple[list[float], list[float], float]]:
        """Per row (semantic confidences, quality confidences, share of attributes truly satisfied) — Note 4."""
        decomposed = [decompose(c, parse_attrs(a, self.domain), self.domain) for c, a in zip(completions, attrs)]
        flat = [qm for sem, qual in decomposed for qm in (*sem, *qual)]
        if self.role is None:
            conf = self._ask_programmatic([m for _, m in flat])
        else:
            conf = self._ask_lm([q for q, _ in flat])
        out, i = [], 0
        for sem, qual in decomposed:
            s, q = conf[i : i + len(sem)], conf[i + len(sem) : i + len(sem) + len(qual)]
            i += len(sem) + len(qual)
            sat = sum(m > 0 for _, m in sem) / len(sem) if sem else 1.0
            out.append((s, q, sat))
        return out

    def accepts_kwarg(self, name: str) -> bool:
        return name == "log_metric"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], log_metric: Any = None, **columns: Any
    ) -> list[float | None]:
        attrs = get_column(columns, self.column, len(completions), "dv_reward")
        todo = [i for i, a in enumerate(attrs) if a is not None]
        scores: list[float | None] = [None] * len(completions)
        if not todo:
            return scores
        parts = self._components([completions[i] for i in todo], [attrs[i] for i in todo])
        for i, (sem, qual, _) in zip(todo, parts):
            scores[i] = dv_reward(sem, qual, self.method)
        if log_metric is not None:
            log_metric("dv_sc", sum(_mean(s) for s, _, _ in parts) / len(parts))
            log_metric("dv_pq", sum(_mean(q) for _, q, _ in parts) / len(parts))
            log_metric("dv_sat", sum(sat for _, _, sat in parts) / len(parts))
        return scores
