"""Behaviour view: every row re-scored under the context it was SAMPLED under (``Rollout.behav_ctx``).

Standard practice, no paper: an importance ratio needs the behaviour policy's probability of the
sampled tokens, π_old(o | the context that produced o). When a strategy samples a row under one
context and trains it under another (LoPE's Lorem-perturbed prompts, spec 61; FBOS-RL's feedback-
augmented prompts, spec 02), that probability is a forward under the sampling context.
``Need("logp", view="behaviour")`` asks the trainer for it (key ``policy@behaviour.logp``).

**Change vs GRPO**: none by itself. A GRPO batch has no ``behav_ctx``: this view is then the
default one (every row under its training context).

**Math** (row (b, g); ``train(b,g)`` = ``ctx[b][g]`` when set, else ``prompt_ids[b]``)::

    context(b,g) = behav_ctx[b][g]   if it is non-empty
                 = train(b,g)        otherwise
    rows         = the rollout with ctx = context, behav_ctx cleared      (completions untouched)

so ``logp`` under this view at token t is log π(y_t | context(b,g), y_<t).

**Defaults**: none; the view has no fields.

**Notes**

1. The token axis, mask, ``loss_mask`` and groups are untouched: token t still predicts the same
   completion token, and the forward shares each distinct context once (``policy.forward``).
2. Rows whose behaviour context is their training context are scored again under it (the values
   equal the default view's): the pass costs one no-grad forward over the whole batch, paid only by
   runs that ask for this view.
3. The view does not edit the groups' prompts, so it may score rows with their own contexts
   (``rollout.ctx``), unlike the prompt-editing views.
4. No ``prompt(meta, key)``: a held-out prompt has no sampling context of its own.
5. Returns a copy (``dataclasses.replace``) with fresh ``extras`` dicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from groupwise.registry import register
from groupwise.types import Rollout


@register("view", "behaviour")
@dataclass
class Behaviour:
    """Each row under the context it was sampled under (``behav_ctx``; its training context where none)."""

    def apply(self, rollout: Rollout, encode: Callable[[Any], list[int]]) -> Rollout:
        ctx = rollout.behaviour_contexts() if rollout.behav_ctx else rollout.ctx
        return dataclasses.replace(
            rollout, ctx=ctx, behav_ctx=[], extras=dict(rollout.extras), extra_levels=dict(rollout.extra_levels)
        )
