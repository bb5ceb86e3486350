"""The standard rollout: G independent samples per prompt from the policy (GRPO, Shao et al. 2024)."""

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
