"""ReMax's rollout: the standard samples plus one greedy completion per prompt, whose reward is the
baseline (Li et al. 2023).

"ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large
Language Models", Ziniu Li, Tian Xu, Yushun Zhang, Zhihang Lin, Yang Yu, Ruoyu Sun, Zhi-Quan Luo,
2023, https://arxiv.org/abs/2310.10505 (Algorithm 1: for each prompt sample one response and decode
one greedily; the greedy response's reward is the baseline). verl generates the greedy batch with
``do_sample=False`` before repeating the prompts ``n`` times, so every sample of a prompt shares
one baseline (``verl/trainer/ppo/ray_trainer.py``, the ``AdvantageEstimator.REMAX`` branch).

**Change vs GRPO**: the rollout collects, besides the G sampled rows per prompt, one greedy row per
prompt, scored by the same rewards and then set aside: it trains nothing, its reward is the group
extra ``baseline_reward`` [B] that the ``remax`` advantage reads.

**Math**::

    batch    = Sample()(ctx)                                # G rows per prompt (refill rounds too)
    greedy   = ctx.rollout([Request(key=i, n=1, sampling={"greedy": True}) for i in batch's prompts])
    baseline_reward[b] = greedy.rewards[b, 0]               # [B], NaN when the greedy reward was excluded

**Defaults**: none; ``ReMax`` has no fields beyond ``Sample``'s (none). ``group_size = 1`` is the
paper's setting (one sample per prompt) [PAPER]; any G works.

**Notes**

1. The greedy request goes through the same rollout context as the samples (sharded over ranks,
   scored by every reward, gathered), so its reward is computed exactly as the rows' are.
2. The greedy rows cost one generation per prompt; their tokens are not in ``tokens_per_s``'s
   numerator (only trained rows are).
3. With dynamic sampling the greedy baseline is generated once, for the kept groups only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.rollout.sample import Sample
from groupwise.types import Request, Rollout


@register("rollout", "remax")
@dataclass
class ReMax(Sample):
    """The standard samples plus a greedy completion per prompt whose reward is ``baseline_reward`` (ReMax)."""

    request_options = ("greedy",)
    collects = ("baseline_reward",)

    def __call__(self, ctx: RolloutContext) -> Rollout:
        batch = super().__call__(ctx)
        baseline = torch.zeros(batch.shape[0])  # [B]
        if batch.shape[0]:
            greedy = ctx.rollout([Request(key=int(k), n=1, sampling={"greedy": True}) for k in batch.prompt_index], 0)
            baseline = greedy.rewards[:, 0].float()  # [B]
        batch.set_extra("baseline_reward", baseline, "group")
        return batch
