"""Rollout strategy ``lac_binding``: GRPO's sampling, plus LAC's held-out measures (spec 10's
behavioural test and the paper's intervention check; design note §3 "10 LAC" Claims).

"LAC: Latent Action Control with Latent-Flow GRPO", arXiv 2605.16961,
https://arxiv.org/abs/2605.16961 (abstract only; the measures are the toy's, [INFERRED]).

**Change vs GRPO**: none to training (``__call__`` is ``sample``'s refill rounds). ``evaluate``
deploys the policy greedily (planner mean, then the ODE) once on each of the 12 ordered pairs
(``binding.greedy_binding``) and reports ``binding_acc`` (bound, in order) and ``donor_follow``
(given the latents of the swapped pair (j, i), the sample draws (j, i): the latents are consumed),
logged as ``eval/binding_acc`` and ``eval/donor_follow``.

**Math** (Y = 12 ordered pairs; x_y the greedy sample of label y, x_y^donor the generator's greedy
sample of label y given the latents of its swapped pair y')::

    binding_acc  = mean_y binding_score(x_y, y)
    donor_follow = mean_y binding_score(x_y^donor, y')

**Defaults**: ``ring = 2`` (the task's) [INFERRED].

**Notes**

1. ``evaluate`` ignores the held-out rows' order and count: the 12 pairs are the whole prompt space.
2. It needs the planner kind with ``dim = 4`` (a ``ConfigError`` names the policy otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.rollout.sample import refill_rounds
from groupwise.types import Rollout, StepInfo

from .binding import greedy_binding


@register("rollout", "lac_binding")
@dataclass
class LacBinding:
    """G independent samples per prompt; held-out: binding accuracy and donor following (module docstring)."""

    ring: float = 2.0  # the task's mode ring

    def __call__(self, ctx: RolloutContext) -> Rollout:
        return refill_rounds(ctx)

    def evaluate(self, ctx: RolloutContext, rows: list[dict], info: StepInfo) -> dict[str, float]:
        """``binding_acc`` and ``donor_follow`` over the 12 ordered pairs (the rows' labels are all of them)."""
        if not hasattr(ctx.policy, "plan_condition") or ctx.policy.dim != 4:  # the planner kind, either planner
            raise ConfigError(
                'rollout lac_binding: evaluate deploys a planner policy with dim = 4 (model.policy = "planner", '
                f"model.params.dim = 4); this one is {ctx.policy.modality} with dim {ctx.policy.dim}"
            )
        return greedy_binding(ctx.policy, self.ring)
