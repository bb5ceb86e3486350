"""Sibling-hint view: each group's prompt re-written with one of the group's OWN correct completions as a hint.

The privileged self-teacher context of SSOPD: "SSOPD: Self-Supervised On-Policy Distillation"
(shortest-correct → longest-wrong), arXiv 2605.17497, 2026 (only the first section was available;
spec: specs/07). ``Need("logprobs", view="sibling_hint")`` scores the sampled completions under it.

**Change vs GRPO**: none by itself. Unlike ``ground_truth`` (a dataset column), the hint here is a
sibling row's completion text, so the view reads the *group*: the rows' rewards (which rows are
correct) and their decoded completions. Completions, mask and the token axis T are untouched, so
token t still predicts the same completion token; every row of group b is scored under the same
edited prompt.

**Math** (per group b; ``lengths[b,g]`` = completion tokens of row g, EOS included)::

    members[b,g] = group_valid[b,g] ∧ isfinite(rewards[b,g])        (rows with a verdict)
    correct[b,g] = members[b,g] ∧ rewards[b,g] ≥ threshold
    h[b]         = argmin_{g: correct} lengths[b,g]   (pick="shortest"; tie → the first such row)
    x_T[b]       = template.format(prompt=x, hint=completions[b][h[b]], **meta)
    prompt_ids[b] = encode(x_T[b])        (unchanged when the group has no correct row)

**Defaults**

- ``template = "Reference solution: {hint}\\n{prompt}"`` [INFERRED] the hint goes BEFORE the
  prompt, so that the completion still continues right after the prompt's last token; it is the
  form the shipped ``hinted`` model was warm-started to read. The spec's example [INFERRED there
  too] ``"{x}\\n\\nA correct solution:\\n{y⁺}\\n\\nNow solve it yourself:\\n"`` is ``SPEC_TEMPLATE``.
- ``pick = "shortest"`` [ABSTRACT] SSOPD's shortest correct completion; ``"longest"`` and
  ``"first"`` (the lowest row index) are options.
- ``threshold = 1.0`` [INFERRED] a row is correct when its total reward is ≥ 1 (the exact-match
  reward's 1; the held-out accuracy's rule). A component that pairs with this view (the ``ssopd``
  term) must use the same threshold: both default to 1.0.

**Notes**

1. Reads ``rollout.rewards`` [B,G] and ``rollout.completions``: it can serve needs computed once a
   step after the rewards (objective terms, token weights, shapers), not a reward scorer's own
   needs (those run before the rewards exist) — that is an error naming the fix.
2. A group without a correct row keeps its own prompt (the teacher is then the student: a
   divergence of 0). Rows without a verdict (NaN reward) and padding rows are never the hint.
3. Template fields: ``{prompt}`` and ``{hint}`` are required; any dataset column may appear too;
   literal braces are ``{{`` ``}}``. The hint is inserted verbatim (``str.format`` does not parse
   the value, so braces in a completion are safe).
4. Chat prompts: the template is applied to the LAST user message of a copy (``edit_user_text``).
5. Only the prompt is edited, but the view has no ``prompt(meta, key)``: a held-out prompt has no
   group, so it cannot be an ``eval.views`` view.
6. Returns a copy (``dataclasses.replace``) with fresh ``extras`` dicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout
from groupwise.views import edit_user_text
from groupwise.views.ground_truth import template_columns

DEFAULT_TEMPLATE = "Reference solution: {hint}\n{prompt}"
SPEC_TEMPLATE = "{prompt}\n\nA correct solution:\n{hint}\n\nNow solve it yourself:\n"  # the spec's example
PICKS = ("shortest", "longest", "first")


def verdicts(rewards: Tensor, group_valid: Tensor, threshold: float = 1.0) -> tuple[Tensor, Tensor]:
    """(members [B,G], correct [B,G]) bool: rows with a verdict (valid, finite reward), and those ≥ threshold."""
    if rewards is None or rewards.dim() != 2:
        raise ValueError(
            f"correct/wrong rows need the total rewards [B,G], got {None if rewards is None else tuple(rewards.shape)}"
        )
    members = group_valid.bool() & torch.isfinite(rewards)  # [B,G]
    correct = members & (rewards >= threshold)  # [B,G]; NaN compares False
    return members, correct


def pick_row(lengths: Tensor, eligible: Tensor, pick: str = "shortest") -> Tensor:
    """[B] long: per group the eligible row of least (``shortest``) or greatest (``longest``) length, or
    the first eligible row (``first``); ties → the lowest index; −1 where no row is eligible."""
    B, G = lengths.shape
    g = torch.arange(G, dtype=torch.long)[None, :]  # [1,G]
    lengths = lengths.long()  # [B,G]
    if pick == "shortest":
        key = lengths * G + g  # [B,G] smallest: shortest, then first
    elif pick == "longest":
        key = -(lengths * G) + g  # [B,G] smallest: longest, then first
    elif pick == "first":
        key = g.expand(B, G)  # [B,G]
    else:
        raise ValueError(f"pick must be one of {', '.join(PICKS)}, got {pick!r}")
    big = torch.iinfo(torch.long).max
    key = torch.where(eligible.bool(), key, torch.full((), big, dtype=torch.long))  # [B,G]
    index = key.argmin(1)  # [B]
    return torch.where(eligible.bool().any(1), index, torch.full((), -1, dtype=torch.long))  # [B]


@register("view", "sibling_hint")
@dataclass
class SiblingHint:
    """Prompt edited to contain one of the group's own correct completions (SSOPD's shortest-correct hint, spec 07)."""

    template: str = DEFAULT_TEMPLATE
    pick: str = "shortest"
    threshold: float = 1.0

    def __post_init__(self) -> None:
        columns = template_columns(self.template)
        if "prompt" not in columns or "hint" not in columns:
            raise ValueError(f"sibling_hint: template {self.template!r} must contain {{prompt}} and {{hint}}")
        if self.pick not in PICKS:
            raise ValueError(f"sibling_hint: pick must be one of {', '.join(PICKS)}, got {self.pick!r}")

    def _hints(self, rollout: Rollout) -> Tensor:
        """[B] long: the row whose completion is each group's hint, −1 where the group has no correct row."""
        if rollout.rewards is None:
            raise ValueError(
                "sibling_hint view reads the group's rewards, which are not scored yet: it serves needs "
                "computed after the rewards (objective terms, weights, shapers), not a reward scorer's needs"
            )
        _, correct = verdicts(rollout.rewards, rollout.group_valid, self.threshold)  # [B,G]
        return pick_row(rollout.mask.sum(-1), correct, self.pick)  # [B]

    def apply(self, rollout: Rollout, encode: Callable[[Any], list[int]]) -> Rollout:
        B, G, _ = rollout.shape
        if len(rollout.meta) != B or len(rollout.completions) != B:
            raise ValueError(
                f"sibling_hint view needs rollout.meta and decoded rollout.completions for each of the {B} groups, "
                f"got {len(rollout.meta)} and {len(rollout.completions)}"
            )
        prompt_ids = []
        for b, h in enumerate(self._hints(rollout).tolist()):
            if h < 0:  # Note 2: no correct sibling, the group's own prompt
                prompt_ids.append(list(rollout.prompt_ids[b]))
                continue
            meta, hint = rollout.meta[b], rollout.completions[b][h]
            text = edit_user_text(
                meta["prompt"],
                lambda t: self.template.format(**{**meta, "prompt": t, "hint": hint}),  # noqa: B023 (called at once, inside this iteration)
                "sibling_hint view",
                b,
            )
            prompt_ids.append(list(encode(text)))  # B token lists
        return dataclasses.replace(
            rollout, prompt_ids=prompt_ids, extras=dict(rollout.extras), extra_levels=dict(rollout.extra_levels)
        )
