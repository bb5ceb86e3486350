"""A frozen LM judge asked yes/no questions: the shared part of the rewards that call one
(``dv_reward``, AlphaGRPO spec 27; ``stage_rubric``'s LM-judge option, RubricEM spec 39).

``yes_no_confidence`` is AlphaGRPO's verdict (P(yes) / (P(yes) + P(no)) over the first answer
token's top log-probs, the answer text when neither word appears); ``ask_judge`` batches questions
through a frozen role's ``Policy.scoring_models`` / ``score``; ``FrozenJudge`` is the mixin of a
reward whose ``judge = "role:NAME"`` field names that role (``components.bind_models``).
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.rewards._common import RewardError

_STRIP = string.whitespace + string.punctuation


def normalise(text: str) -> str:
    """Lower-case, whitespace and punctuation stripped: ``" Yes."`` -> ``"yes"``."""
    return text.strip(_STRIP).lower()


MATCHES = ("word", "prefix")


def verdict_word(text: str, match: str = "word") -> str | None:
    """``"yes"``, ``"no"`` or None: the normalised text is the word (``match="word"``), or a non-empty
    prefix of exactly one of the two words (``match="prefix"``: ``"y"`` -> yes, for a tokenizer that
    splits ``yes`` into ``y``, ``e``, ``s``)."""
    word = normalise(text)
    if match == "word":
        return word if word in ("yes", "no") else None
    hits = [w for w in ("yes", "no") if word and w.startswith(word)]
    return hits[0] if len(hits) == 1 else None


def yes_no_confidence(
    top_logprobs: Mapping[str, float] | Sequence[tuple[str, float]],
    generated_text: str,
    binary: bool = False,
    match: str = "word",
) -> float:
    """P(yes) / (P(yes) + P(no)) over the first token's top log-probs; the answer text decides when neither appears."""
    if match not in MATCHES:
        raise ValueError(f"yes_no_confidence: match={match!r}; use one of {', '.join(MATCHES)}")
    said_yes = float(verdict_word(generated_text, match) == "yes")
    if binary:
        return said_yes
    pairs = top_logprobs.items() if isinstance(top_logprobs, Mapping) else top_logprobs
    p = {"yes": 0.0, "no": 0.0}
    for token, logprob in pairs:
        word = verdict_word(str(token), match)
        if word is not None and math.isfinite(float(logprob)):
            p[word] += math.exp(float(logprob))
    total = p["yes"] + p["no"]
    return p["yes"] / total if total > 0 else said_yes


def ask_judge(
    judge: Any,
    questions: Sequence[str],
    template: str = "{question} Answer yes or no:",
    top_logprobs: int = 5,
    binary: bool = False,
    match: str = "word",
) -> list[float]:
    """A frozen judge policy's yes-confidence on each question (``yes_no_confidence`` of its first
    answer token), one no-grad batch of one-token rows through ``Policy.scoring_models`` / ``score``."""
    from groupwise.types import Rollout

    N = len(questions)
    if N == 0:
        return []
    prompts = [list(judge.encode(template.format(question=q))) for q in questions]
    rows = Rollout(
        prompt_ids=prompts,
        actions=torch.zeros(N, 1, 1, dtype=torch.long),
        mask=torch.ones(N, 1, 1, dtype=torch.bool),
        group_valid=torch.ones(N, 1, dtype=torch.bool),
        truncated=torch.zeros(N, 1, dtype=torch.bool),
        prompt_index=torch.arange(N),
    )
    with torch.no_grad(), judge.scoring_models(with_reference=False)["policy"]() as module:
        logq = judge.score(module, rows, ["logprobs"])["logprobs"][:, 0, 0, :].float().cpu()  # [N,V]
    texts = judge.token_texts()
    top = logq.topk(min(top_logprobs, logq.shape[-1]), dim=-1)  # [N,k]
    return [
        yes_no_confidence([(texts[i], v) for v, i in zip(vals.tolist(), ids.tolist())], texts[ids[0]], binary, match)
        for vals, ids in zip(top.values, top.indices)
    ]


class FrozenJudge:
    """Mixin of a reward whose field ``judge = "role:NAME"`` names a frozen role: ``use_models`` keeps
    that role's policy (``components.bind_models``), ``judge_model`` returns it; the class keeps a
    ``_models`` dict field."""

    judge: str
    template: str
    match: str
    top_logprobs: int
    _models: dict

    @property
    def role(self) -> str | None:
        return self.judge[5:] if self.judge.startswith("role:") else None

    def _who(self) -> str:
        return f"reward {getattr(self, 'registry_name', type(self).__name__)!r}"

    def use_models(self, models: Mapping[str, Any]) -> None:
        """The frozen roles' policies by name; a ``role:`` judge keeps its own (a missing role is refused)."""
        if self.role is None:
            return
        if self.role not in models:
            raise ConfigError(
                f"{self._who()}: judge={self.judge!r} names no frozen role; frozen roles: {sorted(models) or 'none'} "
                f"(add [roles.{self.role}] with frozen = true and its model)"
            )
        self._models = {self.role: models[self.role]}

    def judge_model(self) -> Any:
        if self.role not in self._models:
            raise RewardError(
                f"{self._who()}: judge={self.judge!r} was never given its model; run it in a trainer with "
                f"[roles.{self.role}] frozen = true"
            )
        return self._models[self.role]

    def check_judge(self, programmatic: str) -> None:
        """Validate the judge fields every such reward has: ``judge`` (``programmatic`` or ``role:NAME``),
        ``template`` (with ``{question}``), ``match``, ``top_logprobs``."""
        if self.judge != programmatic and not (self.judge.startswith("role:") and len(self.judge) > 5):
            raise ConfigError(
                f"{self._who()}: judge={self.judge!r}; use {programmatic!r} (the programmatic judge) or 'role:NAME' "
                f"(a frozen LM role roles.NAME)"
            )
        if "{question}" not in self.template:
            raise ConfigError(f"{self._who()}: template={self.template!r} must contain {{question}}")
        if self.match not in MATCHES:
            raise ConfigError(f"{self._who()}: match={self.match!r}; use one of {', '.join(MATCHES)}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or self.top_logprobs < 1:
            raise ConfigError(f"{self._who()}: top_logprobs={self.top_logprobs!r} must be an integer >= 1")
