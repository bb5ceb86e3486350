"""Rewards of the power-flow toy (spec 37): a warm start is worth the Newton–Raphson updates it saves.

Newton's Lantern (arXiv 2605.11102) trains a reward model R_φ(s, x) ≈ n(s, x) on perturbed warm
starts and uses −R_φ; the spec's cheap option, for a system where NR costs microseconds, is the true
count, which is what these rewards compute (``powerflow.iterations``).

**Change vs GRPO**: none; a reward read from the policy's continuous action ``x_final`` [B,G,2].

**Math** (s = the row's observation (P_L, Q_L), x = the warm start (θ, V), n(s, x) of ``powerflow``)::

    nr_iterations = −n(s, x)                  ∈ {−n_max, …, 0}
    nr_converged  = 1 if NR from x reaches the high-voltage root within n_max updates, else 0

**Defaults**

- ``n_max = 20``, ``tol = 1e-8`` [INFERRED] the spec's "e.g. 20" cap; the tolerance of the toy.
- ``weight = 1.0`` as every reward.

**Notes**

1. Rollout scorers (``score_rollout``): they read the row extra ``x_final`` and each row's own
   observation (``Rollout.row_contexts``); the line reactance is the row's ``x_line`` column when
   the row has one, else ``powerflow.X_LINE``.
2. Padding rows (``group_valid`` False) score 0.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

powerflow = importlib.import_module("groupwise.papers.37_newtons_lantern.powerflow")


def _counts(rollout: Rollout, name: str, n_max: int, tol: float) -> tuple[Tensor, Tensor]:
    """(label [B,G], solved [B,G]) of each row's warm start ``x_final`` on its own snapshot."""
    x = rollout.extras.get("x_final")
    if x is None or x.shape[-1] != 2:
        raise ValueError(
            f"{name} needs the row extra 'x_final' [B,G,2] of warm starts (theta, V), written by the gaussian "
            f"policy with dim = 2; got {None if x is None else tuple(x.shape)}"
        )
    B, G, _ = x.shape
    obs = [c if c else [0.0, 0.0] for row in rollout.row_contexts() for c in row]  # B*G observations
    if any(len(c) != 2 for c in obs):
        raise ValueError(f"{name}: an observation must be (P_L, Q_L), 2 numbers; set model.params.obs_dim = 2")
    lines = [float(m.get("x_line", powerflow.X_LINE)) for m in rollout.meta for _ in range(G)]  # B*G
    s = torch.tensor(obs, dtype=torch.float64)  # [B*G,2]
    labels, solved = torch.empty(B * G, dtype=torch.float64), torch.zeros(B * G, dtype=torch.bool)
    for X in sorted(set(lines)):  # one batched solve per line reactance
        rows = torch.tensor([ln == X for ln in lines])  # [B*G]
        labels[rows], solved[rows] = powerflow.iterations(x.reshape(-1, 2)[rows].double(), s[rows], n_max, tol, X)
    valid = rollout.group_valid.bool()  # [B,G]
    return torch.where(valid, labels.view(B, G), 0.0), solved.view(B, G) & valid


def _check(name: str, n_max: int, tol: float) -> None:
    if n_max < 1 or not tol > 0:
        raise ValueError(f"{name}: need n_max >= 1 and tol > 0, got n_max={n_max}, tol={tol}")


@register("reward", "nr_iterations")
@dataclass
class NRIterations:
    """−(Newton–Raphson updates from the warm start to the high-voltage root), n_max when it fails (spec 37)."""

    n_max: int = powerflow.N_MAX
    tol: float = powerflow.TOL
    weight: float = 1.0

    needs = ()
    reads_extras = ("x_final",)  # the warm start (the gaussian policy's action)

    def __post_init__(self) -> None:
        _check("nr_iterations", self.n_max, self.tol)

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        return -_counts(rollout, "nr_iterations", self.n_max, self.tol)[0].float()  # [B,G]


@register("reward", "nr_converged")
@dataclass
class NRConverged:
    """1 if Newton–Raphson from the warm start reaches the high-voltage root within n_max updates (spec 37)."""

    n_max: int = powerflow.N_MAX
    tol: float = powerflow.TOL
    weight: float = 1.0

    needs = ()
    reads_extras = ("x_final",)

    def __post_init__(self) -> None:
        _check("nr_converged", self.n_max, self.tol)

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        return _counts(rollout, "nr_converged", self.n_max, self.tol)[1].float()  # [B,G]
