"""SLAS: super-linear advantage shaping — a signed power (> 1) of group-centred, batch-normalised rewards.

"Power Reinforcement Post-Training of Text-to-Image Models with Super-Linear Advantage Shaping",
Sun, Wang, Song, Lu, Fang, Luo, Yin, Zeng, Zhang, Zhang, Wang, Lu, 2026.
https://arxiv.org/abs/2605.10937 (spec: specs/38; abstract + the arxivlens methodology summary, no code).

**Change vs GRPO**

- No per-prompt std: rewards are centred by the group mean only, then divided by one std taken
  over the centred values of the whole step batch.
- The normalised advantage goes through a signed power ``sign(z)·|z|^(1+gamma)``: deviations beyond
  one batch std are amplified, noise-level ones (|z| < 1) shrunk (an advantage-weighted Fisher–Rao
  metric in the paper).

**Math** (``valid = group_valid & isfinite(r)``; every statistic over valid rows only)::

    dr  = r - mean_g(r)                                  (0 for constant groups)
    order = "norm_then_power":
        z   = dr / (std_batch(dr) + eps)
        adv = sign(z) · |z|^(1 + gamma)
    order = "power_then_norm":
        p   = sign(dr) · |dr|^(1 + gamma)
        adv = p / (std_batch(p) + eps)

**Defaults**

- ``gamma = 0.5`` [INFERRED] the spec's default (the summary gives only γ > 0); ``gamma = 0`` is
  the linear ablation (Dr.GRPO centring with a batch std of the centred values).
- Group-mean centring, no prompt std, batch-level std [PAPER-SUMMARY] the arxivlens methodology
  summary (a third-party summary of the paper, specs/README's tag; not read in the paper itself).
- ``order = "norm_then_power"`` [INFERRED] normalising first makes the |z| = 1 crossover scale-free;
  ``"power_then_norm"`` is the other reading of the summary, an option.
- ``std = "population"`` [INFERRED] the spec's population std over all valid B·G rows;
  ``"unbiased"`` divides by n − 1.
- ``eps = 1e-6`` [INFERRED].

**Notes**

1. The batch std is over every valid row of the step batch, rows of constant groups included (their
   dr is 0): the spec's "over all B·G". The trainer hands estimators the whole (all-rank) batch, so
   the statistic is the same at any world size (``tests/test_dist_scope.py``).
2. Invalid rows (``group_valid`` False or a NaN/inf reward) and constant groups (one valid row
   included) get exactly 0; a batch whose every group is constant is all 0, never NaN.
3. ``power_then_norm`` divides dr by max|dr| before the power: p / std(p) is unchanged by that
   (both scale by the same factor) apart from eps, and |dr|^(1+gamma) cannot overflow for any gamma.
4. ``step_stats()`` logs the last batch's ``slas/batch_std`` (std_batch(dr)) and ``slas/amplified_frac``
   (the fraction of rows with a non-zero advantage whose |adv| exceeds the linear |dr| / std_batch(dr)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import batch_std, group_center, to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

ORDERS = ("norm_then_power", "power_then_norm")
_DDOF = {"population": 0, "unbiased": 1}


def signed_power(x: Tensor, exponent: float) -> Tensor:
    """sign(x) · |x|^exponent, elementwise (0 at 0)."""
    return x.sign() * x.abs().pow(exponent)


def slas_advantages(
    rewards: Tensor, valid: Tensor, gamma: float = 0.5, eps: float = 1e-6, order: str = "norm_then_power", ddof: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """(adv [B,G] float64, std_batch(dr) [] float64, amplified [B,G] bool) of rewards [B,G] over ``valid`` rows."""
    dr = group_center(rewards, valid)  # [B,G] float64, 0 outside valid / in constant groups
    lin_std = batch_std(dr, valid, ddof)  # []
    lin = dr / torch.where(lin_std + eps > 0, lin_std + eps, torch.ones_like(lin_std))  # [B,G] the γ = 0 advantage
    if order == "norm_then_power":
        adv = signed_power(lin, 1.0 + gamma)  # [B,G]
    else:
        top = dr.abs().amax()  # []
        u = dr / torch.where(top > 0, top, torch.ones_like(top))  # [B,G] in [-1, 1]
        p = signed_power(u, 1.0 + gamma)  # [B,G]
        std = batch_std(p, valid, ddof)  # []
        adv = p / torch.where(std + eps > 0, std + eps, torch.ones_like(std))  # [B,G]
    adv = torch.where(valid, adv, torch.zeros((), dtype=adv.dtype))  # [B,G]
    return adv, lin_std, valid & (adv.abs() > lin.abs())


@register("advantage", "slas")
@dataclass
class SLASAdvantage:
    """Signed power of group-centred, batch-std-normalised rewards (SLAS, Sun et al. 2026)."""

    group_relative = True  # needs G >= 2: with one row per group every advantage is 0

    gamma: float = 0.5
    order: str = "norm_then_power"  # "norm_then_power" | "power_then_norm"
    std: str = "population"  # "population" | "unbiased"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not self.gamma >= 0:
            raise ValueError(f"slas: gamma must be >= 0 (0 is the linear ablation), got {self.gamma}")
        if self.order not in ORDERS:
            raise ValueError(f"slas: order must be one of {ORDERS}, got {self.order!r}")
        if self.std not in _DDOF:
            raise ValueError(f"slas: std must be one of {tuple(_DDOF)}, got {self.std!r}")
        if self.eps < 0:
            raise ValueError(f"slas: eps must be >= 0, got {self.eps}")
        self._stats: dict[str, float] = {}

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G], [B,G]
        # [B,G], [], [B,G]
        adv, std, amplified = slas_advantages(r, valid, self.gamma, self.eps, self.order, _DDOF[self.std])
        moved = int((adv != 0).sum())
        self._stats = {"slas/batch_std": float(std), "slas/amplified_frac": float(amplified.sum()) / max(moved, 1)}
        return to_float32(adv)  # [B,G]

    def step_stats(self) -> dict[str, float]:
        """The last batch's std and fraction of amplified advantages (whole batch: no reduction over ranks)."""
        return dict(self._stats)
