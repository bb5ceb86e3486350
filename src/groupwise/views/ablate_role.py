"""Ablated-role view: the same completions with their perception segment emptied, re-scored token by token.

SRPO's reasoning contrast: "Structured Role-Aware Policy Optimization for Multimodal Reasoning",
Bingqing Jiang, Difan Zou, 2026. https://arxiv.org/abs/2605.07274 (spec: specs/51; full paper not
read). ``Need("logp", view="ablate_role")`` gives ``log π(y_t | v, q, P̸, R_<t)`` for every token
that the ablation keeps (reasoning, answer, tags), on the original token axis.

**Change vs GRPO**: none by itself. Unlike a prompt view, this one edits the COMPLETION: the
tokens inside every segment between ``tags`` are removed (``placeholder`` put in their place), so
the tokens after the segment move left. The view returns the edited rows with the position of each
original token in them (``views.Remapped``); the resolver scores the edited rows and maps every
quantity back (removed tokens get 0 and are not scored).

**Math** (row r with tokens y_0 … y_{L−1}; ``P`` = the positions whose token starts inside a
segment, ``textspans.segment_ids``; ``φ`` = the placeholder's token ids)::

    ỹ         = y with every maximal run of positions in P replaced by φ
    pos[t]    = −1 for t ∈ P;  else the index of y_t's copy in ỹ
              = t − |{s ∈ P : s < t}| + |φ| · (runs of P that end before t)
    logp_abl[t] = log π(ỹ_pos[t] | prompt, ỹ_<pos[t]) = log π(y_t | prompt, y_<t with P → φ)

**Defaults**

- ``tags = ["<perception>", "</perception>"]`` [INFERRED] the spec's response format; the tags
  themselves stay, only their content goes.
- ``placeholder = ""`` [INFERRED] the spec's "empty/placeholder segment": the empty one. A
  non-empty placeholder is written with the vocabulary's tokens by greedy longest match (Note 3).

**Notes**

1. Token texts come from the policy's vocabulary (``use_vocabulary``, given when the view is
   built); a token belongs to the segment where its first character lies (``textspans``). A token
   straddling the close tag is removed with the segment.
2. A row without a segment is unchanged (pos[t] = t): its ablated log-probs equal the plain ones.
3. The placeholder's ids: at each position the longest vocabulary text that is a prefix of the
   rest (a valid spelling of it, not necessarily the tokenizer's own); a character no token spells
   is a ``ConfigError`` when the vocabulary arrives.
4. The prompt, groups, ``group_valid`` and the rows' own contexts are untouched; rows with their own
   contexts (``rollout.ctx``) are refused by the resolver, like every view. ``loss_mask`` holes
   move with their tokens (placeholder tokens are not loss tokens). Token-level extras and
   log-probs are not carried into the edited rows (they live on the old axis).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.textspans import check_tags, segment_ids
from groupwise.types import Rollout
from groupwise.views import Remapped


def spell(text: str, token_text: list[str]) -> list[int]:
    """Token ids spelling ``text`` by greedy longest match over the vocabulary (Note 3)."""
    best: dict[str, int] = {}
    for i, t in enumerate(token_text):
        if t and t not in best:
            best[t] = i
    longest = max((len(t) for t in best), default=0)
    ids, at = [], 0
    while at < len(text):
        for n in range(min(longest, len(text) - at), 0, -1):
            if text[at : at + n] in best:
                ids.append(best[text[at : at + n]])
                at += n
                break
        else:
            raise ConfigError(
                f"view ablate_role: no token of the vocabulary spells {text[at]!r} of placeholder {text!r}"
            )
    return ids


def ablate(ids: list[int], inside: list[bool], placeholder: list[int]) -> tuple[list[int], list[int]]:
    """(edited ids, position of each original token in them or −1): every run of ``inside`` tokens → ``placeholder``."""
    out, pos = [], []
    for t, tok in enumerate(ids):
        if inside[t]:
            if t == 0 or not inside[t - 1]:
                out.extend(placeholder)
            pos.append(-1)
        else:
            pos.append(len(out))
            out.append(tok)
    return out, pos


@register("view", "ablate_role")
@dataclass
class AblateRole:
    """Completion with its perception segment emptied; reasoning tokens re-scored after it (SRPO's P̸, Jiang & Zou
    2026)."""

    tags: list = field(default_factory=lambda: ["<perception>", "</perception>"])
    placeholder: str = ""
    _token_text: Any = field(default=None, init=False, repr=False)
    _placeholder_ids: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        check_tags(self.tags, "view ablate_role: tags", need_open=True)
        if not isinstance(self.placeholder, str):
            raise ConfigError(f"view ablate_role: placeholder must be a string, got {self.placeholder!r}")

    def use_vocabulary(self, token_text: list[str]) -> None:
        self._token_text = list(token_text)
        self._placeholder_ids = spell(self.placeholder, self._token_text)

    def apply(self, rollout: Rollout, encode: Callable[[Any], list[int]]) -> Remapped:
        if self._token_text is None:
            raise ValueError(
                "view ablate_role has no vocabulary: it needs a text policy "
                "(the trainer calls use_vocabulary when it builds the view)"
            )
        B, G, T = rollout.shape
        seg = segment_ids(
            rollout.actions.reshape(B * G, T), rollout.mask.reshape(B * G, T), self._token_text, [self.tags]
        ).reshape(B, G, T)  # [B,G,T]
        counts, ids, inside = rollout.mask.sum(-1).tolist(), rollout.actions.tolist(), (seg == 1).tolist()
        edited = [
            [ablate(ids[b][g][: counts[b][g]], inside[b][g][: counts[b][g]], self._placeholder_ids) for g in range(G)]
            for b in range(B)
        ]
        T2 = max((len(e) for row in edited for e, _ in row), default=0)
        actions = torch.zeros(B, G, T2, dtype=torch.long)  # [B,G,T2]
        mask = torch.zeros(B, G, T2, dtype=torch.bool)  # [B,G,T2]
        positions = torch.full((B, G, T), -1, dtype=torch.long)  # [B,G,T]
        loss_mask = None if rollout.loss_mask is None else torch.zeros(B, G, T2, dtype=torch.bool)  # [B,G,T2]
        for b in range(B):
            for g in range(G):
                out, pos = edited[b][g]
                actions[b, g, : len(out)] = torch.tensor(out, dtype=torch.long)
                mask[b, g, : len(out)] = True
                positions[b, g, : len(pos)] = torch.tensor(pos, dtype=torch.long)
                if loss_mask is not None:
                    kept = [(t, p) for t, p in enumerate(pos) if p >= 0]
                    for t, p in kept:
                        loss_mask[b, g, p] = bool(rollout.loss_mask[b, g, t])
        rows = Rollout(
            prompt_ids=[list(p) for p in rollout.prompt_ids],
            actions=actions,
            mask=mask,
            group_valid=rollout.group_valid.clone(),
            truncated=rollout.truncated.clone(),
            prompt_index=rollout.prompt_index.clone(),
            meta=list(rollout.meta),
            loss_mask=loss_mask,
        )
        return Remapped(rows, positions)
