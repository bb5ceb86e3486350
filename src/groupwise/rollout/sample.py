"""The standard rollout: G independent samples per prompt from the policy (GRPO, Shao et al. 2024),
in refill rounds when the sampler drops groups (dynamic sampling, DAPO, Yu et al. 2025).

"DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models", Zhihong Shao,
Peiyi Wang, Qihao Zhu et al., 2024, https://arxiv.org/abs/2402.03300 (GRPO samples a group of G
outputs per question from the old policy). "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale", Qiying Yu et al., 2025, https://arxiv.org/abs/2503.14476 (§3.2: over-sample and filter
out groups whose accuracy is 0 or 1, until the batch is full).

**Change vs GRPO**: none with the default sampler — one round: draw B prompts, G rows each, keep
every group. With a sampler that drops groups (``sampling.name = "dynamic"``) this is DAPO's
refill loop: further rounds draw new prompts until B groups are kept or ``max_rounds`` is reached.

**Math** (``B = rollout.prompts_per_step``, ``G = rollout.group_size``)::

    kept = []
    for round in 0 .. max_rounds-1:
        ids   = ctx.draw(B, round)                                  # the sampler, same on every rank
        batch = ctx.rollout([Request(key=i, n=G, offset=round*G) for i in ids], round)   # scored, whole
        kept += groups of batch where ctx.keep(batch)               # [B] bool, on the whole batch
        stop when |kept| >= B
    return the first min(|kept|, B) kept groups

Row ``j`` of prompt ``i`` in round ``r`` samples with ``sample_seed(seed, step, i, r*G + j)``
(the policy's ``generate``); its mask covers the generated tokens, EOS included.

**Defaults**: none; ``Sample`` has no fields. ``group_size = 8`` [CODE] TRL
``GRPOConfig.num_generations = 8``; ``temperature = 1.0``, ``top_p = 1.0``, ``top_k = 0`` [CODE]
TRL ``GRPOConfig`` defaults (the ``rollout`` config).

**Notes**

1. Each row's randomness depends only on its key, not on the batch it shares or the rank that
   generates it. A refill round shifts the sample index by ``round * G``, so it draws fresh samples
   of a prompt already seen this step; the same prompt drawn twice in one round gets the same seeds.
2. Every round is scored and gathered before ``keep`` decides, so the sampler sees the whole batch
   and every rank's sampler draws the same number of times.
3. A batch with fewer than B kept groups after ``max_rounds`` trains on what was kept (possibly
   nothing: the step is then skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.types import Request, Rollout


@register("rollout", "sample")
@dataclass
class Sample:
    """G independent samples per prompt; refill rounds when the sampler drops groups (GRPO, DAPO)."""

    def __call__(self, ctx: RolloutContext) -> Rollout:
        return refill_rounds(ctx)


def refill_rounds(
    ctx: RolloutContext, hook: Callable[[int, int], Any] | None = None, extras: dict[str, Any] | None = None
) -> Rollout:
    """The module's Math: rounds of B prompts, G rows each, until B groups are kept. ``hook(key, G)``
    gives each request's generation hook (``groupwise.hooks``; strategies that sample under one),
    ``extras`` the row labels of every request (``Request.extras``)."""
    B, G = ctx.batch_size, ctx.group_size
    parts, kept = [], 0
    for round_ in range(ctx.max_rounds):
        ids = ctx.draw(B, round_)
        batch = ctx.rollout(
            [
                Request(key=i, n=G, offset=round_ * G, hook=None if hook is None else hook(i, G), extras=extras)
                for i in ids
            ],
            round_,
        )
        keep = ctx.keep(batch)  # [B] bool
        # no copy when every group is kept
        parts.append(batch if bool(keep.all()) else batch.select(keep.nonzero().flatten()))
        kept += int(keep.sum())
        if kept >= B:
            break
    batch = Rollout.concat(parts)
    return batch if kept == B else batch.select(list(range(min(kept, B))))
