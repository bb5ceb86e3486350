"""``anchor_distance``: the ``sample`` strategy plus a held-out measure of how far the policy's samples are
from a frozen role's (Flow-OPD's MAR claim, design note §3 "45 Flow-OPD" claim (ii): "energy distance of
the student's samples to the base model's, strategy ``evaluate`` with the ``mar`` role").

"Flow-OPD: On-Policy Distillation for Flow Matching Models", arXiv 2605.08063; the paper measures
that MAR keeps image quality near the base model's; this toy measure is [INFERRED].

**Change vs GRPO**: none to training (its rollouts are ``sample``'s); at each held-out evaluation
it draws ``eval_n`` samples per held-out row from the policy and from the frozen role ``anchor``
with the same requests (so the same seeded start noise x_1: paired draws; greedy settings, i.e.
the deterministic ODE from that noise) and reports their energy distance, averaged over rows.

**Math** (one row: X = the policy's samples, Y = the anchor's, n points each in R^D)::

    E(X, Y) = 2·mean_{i≠j} ‖x_i − y_j‖ − mean_{i≠j} ‖x_i − x_j‖ − mean_{i≠j} ‖y_i − y_j‖

(Székely & Rizzo's energy distance, every term over pairs of different draws: x_i and y_i share their
start noise, so the cross term leaves them out too; 0 in expectation when the two distributions are
equal, > 0 otherwise). Logged as ``eval/anchor_energy`` and, after training,
``anchor_energy_after`` in ``summary.json`` (claims metric ``after:anchor_energy``).

**Defaults**: ``anchor = "mar"``, ``eval_n = 32`` [INFERRED] the toy.

**Notes**

1. Both models generate through their own policy's ``generate`` (the frozen role's, given by
   ``use_models``), with the held-out call's settings (greedy: the ODE from the seeded start noise).
2. A policy without the row extra ``x_final`` (not a flow toy) has nothing to compare: a ``KeyError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.rollout.sample import Sample
from groupwise.types import Request, StepInfo


def energy_distance(x: Tensor, y: Tensor) -> Tensor:
    """[...] E(X, Y) for samples x, y [..., n, D] (module docstring); n >= 2."""
    n = x.shape[-2]
    off = ~torch.eye(n, dtype=torch.bool)  # [n,n] the i ≠ j pairs
    xy = torch.cdist(x.double(), y.double())[..., off].mean(-1)  # [...]
    xx = torch.cdist(x.double(), x.double())[..., off].mean(-1)  # [...]
    yy = torch.cdist(y.double(), y.double())[..., off].mean(-1)  # [...]
    return 2 * xy - xx - yy  # [...]


@register("rollout", "anchor_distance")
@dataclass
class AnchorDistance(Sample):
    """``sample``'s rollouts; held out, the energy distance of the policy's samples to a frozen role's."""

    anchor: str = "mar"  # the frozen role (roles.NAME, frozen = true) whose samples are the reference
    eval_n: int = 32  # [INFERRED] samples per held-out row from each model

    def __post_init__(self) -> None:
        if self.eval_n < 2:
            raise ConfigError(f"rollout anchor_distance: eval_n must be >= 2 (pairs of samples), got {self.eval_n}")
        self._anchor: Any = None

    def use_models(self, models: dict[str, Any]) -> None:
        if self.anchor not in models:
            raise ConfigError(
                f"rollout anchor_distance: anchor {self.anchor!r} is not a frozen role "
                f"(frozen roles: {sorted(models) or 'none'}); add roles.{self.anchor} with frozen = true"
            )
        self._anchor = models[self.anchor]

    def evaluate(self, ctx: RolloutContext, rows: list[dict], info: StepInfo) -> dict[str, float]:
        requests = [Request(key=i, n=self.eval_n, prompt=ctx.prompt(i)) for i in range(len(rows))]
        with torch.no_grad():
            mine = ctx.policy.generate(requests, ctx.sampling, info).extras["x_final"]  # [B,n,D]
            theirs = self._anchor.generate(requests, ctx.sampling, info).extras["x_final"]  # [B,n,D]
        return {"anchor_energy": float(energy_distance(mine, theirs).mean())}
