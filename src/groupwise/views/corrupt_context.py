"""Corrupted-context view: the same rows, re-scored with the prompt's evidence passage swapped for another row's.

SRPO's perception contrast: "Structured Role-Aware Policy Optimization for Multimodal Reasoning",
Bingqing Jiang, Difan Zou, 2026. https://arxiv.org/abs/2605.07274 (spec: specs/51; full paper not
read). The paper corrupts the image (blur, noise, masking); the text analogue replaces the context
passage. ``Need("logp", view="corrupt_context")`` scores the sampled completions under it.

**Change vs GRPO**: none by itself. A view edits the context a ``Need`` is evaluated under: every
group's prompt has its passage (the dataset column ``column``, found verbatim in the prompt)
replaced by the passage of another training row, chosen by a seed; completions, mask and the
token axis T are untouched, so token t still predicts the same completion token.

**Math** (per group b, ``meta = rollout.meta[b]``, ``k = rollout.prompt_index[b]`` its dataset row)::

    pool          = the train rows' non-empty ``column`` values, in dataset order   (use_rows)
    j             = Random(seed · 1_000_003 + k).randrange(|pool|), then j+1, j+2, … (cyclic)
                    until pool[j] ≠ meta[column]
    x̃[b]          = meta["prompt"] with its first occurrence of meta[column] replaced by pool[j]
    prompt_ids[b] = encode(x̃[b])

**Defaults**

- ``column = "passage"`` [INFERRED] the ``evidence`` task's column (``tasks/evidence.py``).
- ``seed = 0`` [INFERRED] the donor of a row depends only on (seed, its dataset row): the same at
  every step, on every rank and for any batch.
- ``on_missing = "keep"`` [INFERRED] a group with nothing to corrupt (no such column, the passage not
  in its prompt, no other passage in the pool) keeps its prompt, so its contrast is 0; ``"raise"``
  stops instead (what a recipe on a task with passages should set). The spec: "context passage
  replaced by a random passage of equal length" [INFERRED]; here the donor is another row's
  passage, whose length is the task's (all of ``evidence``'s passages are equally long).

**Notes**

1. Donors come from the training rows (``use_rows``, given at build; components.py), never from the
   batch, so a row's corrupted context does not depend on which rows share its step or rank.
   Without ``use_rows`` (no pool) every group is "missing".
2. Chat prompts (``meta["prompt"]`` a list of messages): the passage is replaced in the content of
   the LAST user message, on a copy; ``encode`` then applies the chat template.
3. ``prompt(meta, key)`` is the edited prompt of one dataset row, so held-out prompts can be scored
   under the view (``eval.views = ["corrupt_context"]``: ``eval_accuracy@corrupt_context``, and
   ``eval_gap@corrupt_context``, the grounding gap). The reward still compares with the row's own
   answer. Held-out rows draw donors from the train rows too.
4. ``data.system_prompt`` is not re-applied to an edited prompt (as ``ground_truth``).
5. ``apply`` returns a copy (``dataclasses.replace``) with fresh ``extras`` dicts.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.types import Rollout
from groupwise.views import edit_user_text

MISSING = ("keep", "raise")


@register("view", "corrupt_context")
@dataclass
class CorruptContext:
    """Prompt with its evidence passage replaced by another train row's passage (SRPO's corrupted input, Jiang & Zou
    2026)."""

    column: str = "passage"
    seed: int = 0
    on_missing: str = "keep"  # "keep" | "raise"
    _pool: list | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.on_missing not in MISSING:
            raise ConfigError(f"view corrupt_context: on_missing must be one of {MISSING}, got {self.on_missing!r}")
        if not isinstance(self.column, str) or not self.column:
            raise ConfigError(f"view corrupt_context: column must name a dataset column, got {self.column!r}")

    def use_rows(self, rows: list[dict]) -> None:
        self._pool = [r[self.column] for r in rows if isinstance(r.get(self.column), str) and r[self.column]]

    def _donor(self, passage: str, key: int) -> str | None:
        """Another row's passage for dataset row ``key`` (Math), or None when the pool has no other."""
        pool = self._pool or []
        if not pool:
            return None
        j = random.Random(self.seed * 1_000_003 + int(key)).randrange(len(pool))
        for step in range(len(pool)):
            other = pool[(j + step) % len(pool)]
            if other != passage:
                return other
        return None

    def prompt(self, meta: dict[str, Any], key: int) -> Any:
        """The edited prompt of one dataset row (``key``: its index),
        or the row's own prompt (``on_missing="keep"``)."""
        passage = meta.get(self.column)
        prompt = meta.get("prompt")
        text = (
            prompt
            if isinstance(prompt, str)
            else next(
                (
                    m.get("content", "")
                    for m in reversed(prompt or [])
                    if isinstance(m, dict) and m.get("role") == "user"
                ),
                "",
            )
        )
        why = None
        if not isinstance(passage, str) or not passage:
            why = f"has no {self.column!r} column (columns: {sorted(meta)})"
        elif passage not in text:
            why = f"has a {self.column!r} that its prompt does not contain"
        else:
            other = self._donor(passage, key)
            if other is None:
                why = f"has no donor: the train rows hold no other {self.column!r}" + (
                    "" if self._pool is not None else " (use_rows was never called)"
                )
            else:
                return edit_user_text(prompt, lambda t: t.replace(passage, other, 1), "corrupt_context view", key)
        if self.on_missing == "raise":
            raise ValueError(
                f"corrupt_context view: dataset row {key} {why}; give the "
                "task a passage column (views.corrupt_context.column) "
                f'or set views.corrupt_context.on_missing="keep"'
            )
        return prompt

    def apply(self, rollout: Rollout, encode: Callable[[Any], list[int]]) -> Rollout:
        B = len(rollout.prompt_ids)
        if len(rollout.meta) != B:
            raise ValueError(
                f"corrupt_context view needs rollout.meta for each of the {B} groups, got {len(rollout.meta)}"
            )
        prompt_ids = []
        for b, meta in enumerate(rollout.meta):
            edited = self.prompt(meta, int(rollout.prompt_index[b]))
            # B token lists
            prompt_ids.append(list(rollout.prompt_ids[b]) if edited is meta.get("prompt") else list(encode(edited)))
        return dataclasses.replace(
            rollout, prompt_ids=prompt_ids, extras=dict(rollout.extras), extra_levels=dict(rollout.extra_levels)
        )
