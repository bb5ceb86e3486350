"""F-GRPO's two reward channels: order-invariant coverage of the generated set, position-aware ranking utility.

"F-GRPO: Factorized Group-Relative Policy Optimization" (generate-then-rank), Surana, Mundada, Wu,
Li, Jiao, Jin, Zhou, Yu, Sinha, Han, Shang, McAuley, 2026. https://arxiv.org/abs/2605.12995
(spec: specs/24; abstract + a third-party brief only, no code).

**Change vs GRPO**: a completion is two segments — a candidate set, then a ranking of it — and each
gets its own reward: ``recall_at_k`` scores the set (coverage, order-invariant), ``ndcg_at_k`` the
ranking (position-aware). Each is one column of ``reward_parts``; the advantage ``f_grpo``
normalises each over the group and credits each to its own phase's tokens.

**Math** (``S`` the ids listed in the candidate segment, ``r`` the ranking, ``gain`` the row's graded
relevance, ``Rel = {i : gain_i > 0}``)::

    recall_at_k:  R_gen  = |S ∩ Rel| / min(|Rel|, k)        0 if |S| > max_set or no candidate segment
    ndcg_at_k:    R_rank = DCG@k(r) / IDCG@k                 DCG@k(r) = Σ_{pos ≤ k} gain(r_pos) / log2(pos + 1)
                  IDCG@k = DCG@k of Rel sorted by gain       (mode="plain")
                  IDCG@k = DCG@k of S ∩ Rel sorted by gain   (mode="conditional"; 0 if S ∩ Rel = ∅)
                  R_rank = 0 for an invalid ranking: no candidate segment, a duplicate, an id not in S

Format (``cand_tags = [open, close]``, ``rank_tags`` likewise; ids separated by ``,``, ``>`` or spaces)::

    <open> id, id, … <close> <rank open> id > id > … <rank close>       toy: "[B,D,G]D>G>B"

**Defaults**

- ``k = 3`` [INFERRED] the spec's analogue (K = 3); ``max_set = None`` → ``k`` [INFERRED] a larger
  set would buy coverage for free (listing the whole pool gives R_gen = 1).
- ``mode = "plain"`` [INFERRED] the spec's R_rank; ``"conditional"`` is its option (ranking skill
  apart from coverage).
- ``cand_tags = ["[", "]"]``, ``rank_tags = ["", ""]`` [INFERRED] the toy's compact format (the
  embedded tokenizer spells ``<cand>`` as six tokens); the spec's form is ``["<cand>", "</cand>"]``,
  ``["<rank>", "</rank>"]``.
- ``column = "gains"`` [INFERRED] a dataset column mapping each relevant id to its gain
  (``papers/24_f_grpo/ranking.py``); a list is read as binary relevance.
- ``weight = 1.0`` [CODE] TRL's default reward weight.

**Notes**

1. Gains come from the row (``{"D": 3, "G": 2, "B": 1}``, or a list of relevant ids = gain 1 each);
   a row with no relevant item gets ``None`` (no verdict) from both rewards.
2. The candidate segment is the text between the first ``open`` and the next ``close``; the ranking
   is what follows, after an optional ``rank open`` and up to ``rank close`` when given.
   ``phase_boundary`` (the character where the ranking phase starts) is what ``f_grpo``'s phase
   masks use, so rewards and masks agree on where the phases meet.
3. Duplicates in the candidate segment count once (a set); ids outside the pool are simply not relevant.
4. ``fgrpo_rewards`` is the spec's interface on already parsed lists.
5. ``ndcg_at_1`` is ``ndcg_at_k`` with ``k = 1`` (NDCG@1, the spec's top-rank metric), for ``eval.reward``,
   which takes a registry name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rewards._common import get_column
from groupwise.textspans import check_tags

_SEP = re.compile(r"[,>\s]+")


def phase_boundary(text: str, cand_tags: Sequence[str]) -> int | None:
    """The character index right after the candidate segment's close tag; None without one."""
    open_tag, close_tag = cand_tags
    start = text.find(open_tag)
    if start < 0:
        return None
    end = text.find(close_tag, start + len(open_tag))
    return None if end < 0 else end + len(close_tag)


def parse_ranking(
    text: str, cand_tags: Sequence[str], rank_tags: Sequence[str] = ("", "")
) -> tuple[list[str], list[str]] | None:
    """(candidate ids, ranked ids) of a completion, or None when it has no candidate segment."""
    cut = phase_boundary(text, cand_tags)
    if cut is None:
        return None
    inner = text[text.find(cand_tags[0]) + len(cand_tags[0]) : cut - len(cand_tags[1])]
    rest = text[cut:].lstrip()
    if rank_tags[0]:
        rest = rest[len(rank_tags[0]) :] if rest.startswith(rank_tags[0]) else ""
    if rank_tags[1] and rank_tags[1] in rest:
        rest = rest[: rest.index(rank_tags[1])]
    return [x for x in _SEP.split(inner) if x], [x for x in _SEP.split(rest) if x]


def read_gains(value: Any) -> dict[str, float]:
    """A row's graded relevance: ``{id: gain}``, or a list of relevant ids (gain 1 each)."""
    if isinstance(value, Mapping):
        return {str(k): float(v) for k, v in value.items() if float(v) > 0}
    if isinstance(value, (list, tuple)):
        return {str(k): 1.0 for k in value}
    raise ValueError(f"relevance must be a {{id: gain}} mapping or a list of ids, got {type(value).__name__}")


def dcg(gains: Sequence[float], k: int) -> float:
    """Σ_{pos ≤ k} gain_pos / log2(pos + 1), pos from 1."""
    return sum(g / math.log2(pos + 2) for pos, g in enumerate(gains[:k]))


def recall_score(cand: Sequence[str] | None, gains: Mapping[str, float], k: int, max_set: int) -> float:
    """R_gen = |S ∩ Rel| / min(|Rel|, k); 0 without a candidate segment or with |S| > max_set."""
    if cand is None or len(set(cand)) > max_set:
        return 0.0
    return len(set(cand) & set(gains)) / min(len(gains), k)


def ndcg_score(
    rank: Sequence[str] | None,
    gains: Mapping[str, float],
    k: int,
    cand: Sequence[str] | None = None,
    mode: str = "plain",
) -> float:
    """R_rank = DCG@k(rank) / IDCG@k (module Math); 0 for an invalid ranking."""
    if rank is None or not rank or len(set(rank)) < len(rank) or (cand is not None and not set(rank) <= set(cand)):
        return 0.0
    pool = gains if mode == "plain" else {i: g for i, g in gains.items() if cand is not None and i in set(cand)}
    ideal = dcg(sorted(pool.values(), reverse=True), k)
    return dcg([gains.get(i, 0.0) for i in rank], k) / ideal if ideal > 0 else 0.0


def fgrpo_rewards(
    pred_sets: Sequence[Sequence[str]], pred_ranks: Sequence[Sequence[str]], rel: Any, k: int, mode: str = "plain"
) -> tuple[Tensor, Tensor]:
    """The spec's interface for one group: (R_gen [G], R_rank [G]) float32 from parsed sets and rankings."""
    gains = read_gains(rel)
    r_gen = [recall_score(s, gains, k, len(s)) for s in pred_sets]
    r_rank = [ndcg_score(r, gains, k, s, mode) for s, r in zip(pred_sets, pred_ranks, strict=True)]
    return torch.tensor(r_gen, dtype=torch.float32), torch.tensor(r_rank, dtype=torch.float32)


@dataclass
class _RankingReward:
    k: int = 3
    column: str = "gains"
    cand_tags: list = field(default_factory=lambda: ["[", "]"])
    rank_tags: list = field(default_factory=lambda: ["", ""])
    weight: float = 1.0

    def __post_init__(self) -> None:
        name = self.registry_name
        if self.k < 1:
            raise ConfigError(f"reward {name}: k must be >= 1, got {self.k}")
        check_tags(self.cand_tags, f"reward {name}: cand_tags", need_open=True)
        check_tags(self.rank_tags, f"reward {name}: rank_tags", need_open=False)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        rels = get_column(columns, self.column, len(completions), self.registry_name)
        out: list[float | None] = []
        for text, rel in zip(completions, rels, strict=True):
            gains = read_gains(rel) if rel is not None else {}
            out.append(self._score(parse_ranking(str(text), self.cand_tags, self.rank_tags), gains) if gains else None)
        return out


@register("reward", "recall_at_k")
@dataclass
class RecallAtK(_RankingReward):
    """Order-invariant coverage of the candidate segment: |S ∩ Rel| / min(|Rel|, k) (F-GRPO's R_gen)."""

    max_set: int | None = None  # None: k

    def _score(self, parsed: tuple[list[str], list[str]] | None, gains: dict[str, float]) -> float:
        return recall_score(parsed[0] if parsed else None, gains, self.k, self.max_set or self.k)


@register("reward", "ndcg_at_k")
@dataclass
class NDCGAtK(_RankingReward):
    """Position-aware utility of the ranking segment: NDCG@k, 0 for an invalid ranking (F-GRPO's R_rank)."""

    mode: str = "plain"  # "plain" | "conditional"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in ("plain", "conditional"):
            raise ConfigError(f"reward ndcg_at_k: mode must be 'plain' or 'conditional', got {self.mode!r}")

    def _score(self, parsed: tuple[list[str], list[str]] | None, gains: dict[str, float]) -> float:
        return ndcg_score(parsed[1], gains, self.k, parsed[0], self.mode) if parsed else 0.0


@register("reward", "ndcg_at_1")
@dataclass
class NDCGAt1(NDCGAtK):
    """NDCG@1 of the ranking segment: 1 when the top-ranked item has the best gain (``eval.reward`` takes a name
    only)."""

    k: int = 1
