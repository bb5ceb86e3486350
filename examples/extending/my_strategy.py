"""A plug-in rollout strategy: the sampling temperature anneals from ``start`` to ``end`` over the run.

Not registered: strategy.toml names it by module and class, ``rollout.name =
"my_strategy:AnnealedTemperature"`` (docs/extending.md). A strategy owns the collection of a step's
batch through the rollout context: it draws prompts, asks for groups (``Request``), and keeps what
the sampler keeps.

**Change vs GRPO**: explore more early (hot samples), exploit later (cool ones), without touching
the rest of the loop.

**Math** (step ``k`` of ``K = train.steps``)::

    temperature_k = start * (end / start) ** (k / (K - 1))        geometric, start at k = 0, end at K - 1

**Logged**: ``anneal/temperature``, the step's temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

from groupwise.types import Request, Rollout


@dataclass
class AnnealedTemperature:
    """Sample each step's groups at a temperature annealed from start to end (example plug-in)."""

    start: float = 1.2
    end: float = 0.6

    request_options = ("temperature",)  # the Request.sampling keys it sets (checked against the policy's at build)
    collects = ()  # the rollout extras it fills for other components: none

    def __post_init__(self) -> None:
        if not (self.start > 0 and self.end > 0):
            raise ValueError(f"my_strategy: temperatures must be > 0, got start={self.start}, end={self.end}")
        self.temperature = self.start

    def __call__(self, ctx) -> Rollout:
        info = ctx.info(0)
        progress = info.step / max(1, info.total_steps - 1)
        self.temperature = self.start * (self.end / self.start) ** progress
        ids = ctx.draw(ctx.batch_size)  # this step's prompts (the same on every rank)
        requests = [Request(key=i, n=ctx.group_size, sampling={"temperature": self.temperature}) for i in ids]
        batch = ctx.rollout(requests)  # generated, scored, gathered: [B,G,T]
        keep = ctx.keep(batch)  # [B] bool, the sampler's verdict (all True for the uniform sampler)
        return batch if bool(keep.all()) else batch.select(keep.nonzero().flatten())

    def step_stats(self) -> dict[str, float]:
        return {"anneal/temperature": self.temperature}
