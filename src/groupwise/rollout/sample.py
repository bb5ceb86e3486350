"""The standard rollout: G independent samples per prompt from the policy (GRPO, Shao et al. 2024).

"DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models", Zhihong Shao,
Peiyi Wang, Qihao Zhu et al., 2024, https://arxiv.org/abs/2402.03300 (GRPO samples a group of G
outputs per question from the old policy).

**Change vs GRPO**: none — this is GRPO's sampling step: G completions per prompt, drawn
independently, one engine call for the whole batch.

**Math** (``G = group_size``; row ``b*G + j`` is sample ``j`` of prompt ``b``)::

    seeds[b*G + j] = sample_seed(info.seed, info.step, prompt_index[b], info.round * G + j)   # [B*G]
    gen  = engine.generate(prompt_ids, G, seeds, max_new_tokens, **sampling)
    mask = arange(T)[None, None, :] < gen.lengths[..., None]                                # [B,G,T]
    Rollout(prompt_ids, actions=gen.tokens, mask, group_valid=ones(B, G),
            truncated=gen.truncated, prompt_index, logp_sampler=gen.logp)

**Defaults**: none; ``Sample`` has no fields. Its inputs come from the ``rollout`` config:
``group_size = 8`` [CODE] TRL ``GRPOConfig.num_generations = 8``; ``sampling`` =
``temperature = 1.0``, ``top_p = 1.0``, ``top_k = 0`` [CODE] TRL ``GRPOConfig`` defaults.

**Notes**

1. Each row's randomness depends only on its key (seed, step, dataset row id, sample index), not
   on the batch it shares or the rank that generates it. A refill round (dynamic sampling) shifts
   the sample index by ``round * G``, so it draws fresh samples of a prompt already seen this step.
   The same prompt drawn twice in one round gets the same seeds, and so the same completions.
2. ``T`` is the longest completion actually generated; ``mask`` covers each row's generated
   tokens, the EOS token included when one was generated. Every row starts valid (``group_valid``
   all True); the reward stage clears it where a row's total reward is NaN.
3. ``logp_sampler`` is the engine's raw-model (temperature 1) log-prob of each sampled token, 0
   after the row's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from groupwise.engines.seeds import sample_seed
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("rollout", "sample")
@dataclass
class Sample:
    """G independent samples per prompt, one engine call for the whole batch (GRPO)."""

    def __call__(self, engine: Any, prompt_ids: list[list[int]], prompt_index: list[int], group_size: int, max_new_tokens: int, sampling: dict, info: StepInfo) -> Rollout:
        seeds = [sample_seed(info.seed, info.step, p, info.round * group_size + j) for p in prompt_index for j in range(group_size)]
        gen = engine.generate(prompt_ids, group_size, torch.tensor(seeds, dtype=torch.long), max_new_tokens, **sampling)
        B, G, T = gen.tokens.shape
        positions = torch.arange(T)  # [T]
        mask = positions[None, None, :] < gen.lengths[..., None]  # [B,G,T]
        return Rollout(
            prompt_ids=prompt_ids,
            actions=gen.tokens,  # [B,G,T]
            mask=mask,  # [B,G,T]
            group_valid=torch.ones(B, G, dtype=torch.bool),  # [B,G]
            truncated=gen.truncated,  # [B,G]
            prompt_index=torch.tensor(prompt_index, dtype=torch.long),  # [B]
            logp_sampler=gen.logp,  # [B,G,T]
        )
