"""What a rollout strategy is given: ``strategy(ctx) -> Rollout`` owns the collection of a step's batch.

A strategy decides which prompts to ask for, how many rows each, in how many rounds, and what to
keep; the context does the mechanics the same way for every strategy:

- ``draw(n, round)`` — the next ``n`` prompt ids from the sampler (identical on every rank);
- ``rollout(requests, round)`` — the whole scored batch for these requests: each rank generates
  its share with the policy, the text rewards and the round's no-grad needs run on that share, the
  shares are gathered, and the rollout scorers and the weighted total run on the whole batch
  (``rewards`` [B,G], ``group_valid``); identical on every rank;
- ``keep(batch)`` — the sampler's whole-batch verdict per group ([B] bool), ``max_rounds``.

It also counts, over every batch it scored, how many rows had a finite reward (``finite_fraction``),
which the trainer uses to stop a run whose rewards are never finite.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from groupwise import dist
from groupwise.types import Request, Rollout, StepInfo


class RolloutContext:
    def __init__(self, policy: Any, sampler: Any, reward_stage: Any, fill_needs: Callable[[Rollout], None], prompt: Callable[[int], Any],
                 meta: Callable[[int], dict], info: Callable[[int], StepInfo], sampling: dict, batch_size: int, group_size: int):
        self.policy, self.sampler, self.reward_stage, self.fill_needs = policy, sampler, reward_stage, fill_needs
        self.prompt, self.meta, self.info, self.sampling = prompt, meta, info, sampling
        self.batch_size, self.group_size = batch_size, group_size
        self.max_rounds = max(1, getattr(sampler, "max_rounds", 1))
        self.finite, self.scored = 0, 0

    def draw(self, n: int, round_: int = 0) -> list[int]:
        return self.sampler.draw(n, self.info(round_))

    def rollout(self, requests: list[Request], round_: int = 0) -> Rollout:
        info = self.info(round_)
        start, stop = dist.shard_bounds(len(requests))
        mine = [Request(r.key, r.n, r.offset, self.prompt(r.key)) for r in requests[start:stop]]
        local = self.policy.generate(mine, self.sampling, info)
        local.meta = [self.meta(r.key) for r in mine]
        self.reward_stage.score_local(local)
        self.fill_needs(local)
        batch = dist.gather_rollout(local)
        real = batch.group_valid.clone()  # [B,G] rows that exist (not the padding of ragged groups)
        self.reward_stage.finish(batch, info)
        self.finite += int((torch.isfinite(batch.rewards) & real).sum())
        self.scored += int(real.sum())
        return batch

    def keep(self, batch: Rollout) -> torch.Tensor:
        return self.sampler.keep(batch)  # [B] bool

    @property
    def finite_fraction(self) -> float:
        return self.finite / max(1, self.scored)
