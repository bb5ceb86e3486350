"""KVPO's anchor advantage: each routed branch against the group's unperturbed anchor generation.

"KVPO: ODE-native GRPO for streaming autoregressive video via KV-cache semantic exploration",
arXiv 2605.14278, https://arxiv.org/abs/2605.14278 (spec 21); the reference read for the formula is
the authors' trainer, https://github.com/Richard-Zhang-AI/KVPO ``models/longlive/trainer/kvpo.py``
(as quoted by the spec; status FULL).

**Change vs GRPO**: the baseline is not the group mean but one row of the group, the *anchor*: a
generation from the same noise with the clean cache (row flag ``anchor``, ``types.ANCHOR``; its
reward enters the statistics, the row itself is never trained). Each reward column (the toy's
``traj_local`` and ``traj_global``, the paper's local-chunk and whole-video scores) gets its own
anchor advantage, the columns are fused, and the result is clamped.

**Math** (group b; branch rows g = the valid, non-anchor rows; ``r_k`` the k-th reward column,
``rollout.reward_parts[..., k]``, or the total ``rewards`` when the batch has no parts)::

    A_k(g) = (r_k(g) − r_k(anchor)) / (std_unbiased([r_k(1..K), r_k(anchor)]) + 1e-8)
    fusion = "std":  A(g) = Σ_k w_k · A_k(g) / std_pop,g(A_k)      (the division skipped when std_pop <= 1e-8)
    fusion = "sum":  A(g) = Σ_k w_k · A_k(g)
    A(g)   = clamp(A(g), −adv_clip, adv_clip);   A(anchor) = 0

**Defaults**

- ``weights = [1.0, 0.5]`` [CODE] ``advantage_fusion_mode = "std"`` with local weight 1.0 and global
  weight 0.5, in the order of the reward columns (``rewards`` of the config: local first).
- ``fusion = "std"`` [CODE]; ``"sum"`` is the plain weighted sum (one column: the anchor advantage).
- ``eps = 1e-8`` [CODE] added to the unbiased std; ``adv_clip = 2.5`` [CODE] ``adv_clip_max``.

**Notes**

1. Every group must hold exactly one valid anchor row with finite rewards; otherwise the estimator
   names the group and the fix (the strategy ``kv_branches`` makes one per prompt).
2. The population std of the fusion is over the group's branch rows [INFERRED]: the authors' batch
   on one GPU is one prompt's branches, so per group is the same statistic.
3. A branch row with a NaN in a column gets advantage 0 and is left out of that column's statistics;
   invalid rows and the anchor get exactly 0. Statistics are float64, the output float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from groupwise.masked import to_float32
from groupwise.registry import register
from groupwise.types import ANCHOR, Rollout, StepInfo

FUSIONS = ("std", "sum")


def anchor_advantages(r: Tensor, branches: Tensor, anchor: Tensor, eps: float = 1e-8) -> Tensor:
    """[B,G] float64 (r − r_anchor)/(std_unbiased(branches ∪ anchor) + eps) on ``branches`` [B,G], 0 elsewhere;
    ``anchor`` [B,G] marks one row per group."""
    r = r.double()
    r_anchor = torch.where(anchor, r, torch.zeros((), dtype=r.dtype)).sum(1, keepdim=True)  # [B,1]
    members = branches | anchor  # [B,G]
    n = members.sum(1, keepdim=True).double()  # [B,1]
    mean = torch.where(members, r, torch.zeros((), dtype=r.dtype)).sum(1, keepdim=True) / n.clamp(min=1)  # [B,1]
    sq = torch.where(members, (r - mean) ** 2, torch.zeros((), dtype=r.dtype)).sum(1, keepdim=True)  # [B,1]
    std = (sq / (n - 1).clamp(min=1)).sqrt()  # [B,1] unbiased (torch.std)
    adv = (r - r_anchor) / (std + eps)  # [B,G]
    return torch.where(branches, adv, torch.zeros((), dtype=adv.dtype))  # [B,G]


def population_std(a: Tensor, rows: Tensor) -> Tensor:
    """[B,1] the population std of ``a`` [B,G] over each group's ``rows``."""
    n = rows.sum(1, keepdim=True).double().clamp(min=1)  # [B,1]
    mean = torch.where(rows, a, torch.zeros((), dtype=a.dtype)).sum(1, keepdim=True) / n  # [B,1]
    return (torch.where(rows, (a - mean) ** 2, torch.zeros((), dtype=a.dtype)).sum(1, keepdim=True) / n).sqrt()


@register("advantage", "kvpo")
@dataclass
class KVPOAdvantage:
    """Anchor-relative advantage per reward column, std-fused and clamped (KVPO, arXiv 2605.14278)."""

    weights: list[float] = field(default_factory=lambda: [1.0, 0.5])
    fusion: str = "std"
    eps: float = 1e-8
    adv_clip: float = 2.5

    group_relative = True
    modality = "ar_flow"  # the anchor rows come from kv_branches on the ar_flow policy

    def __post_init__(self) -> None:
        if self.fusion not in FUSIONS:
            raise ValueError(f"kvpo: fusion must be one of {FUSIONS}, got {self.fusion!r}")
        if not self.weights or not self.adv_clip > 0 or self.eps < 0:
            raise ValueError(
                f"kvpo: need weights (one per reward column), adv_clip > 0 and eps >= 0; got weights={self.weights}, "
                f"adv_clip={self.adv_clip}, eps={self.eps}"
            )

    def _columns(self, rollout: Rollout) -> Tensor:
        """[B,G,K] float64 reward columns (the parts, or the total as one column)."""
        if rollout.rewards is None:
            raise ValueError("advantage kvpo needs rollout.rewards; run the reward stage first")
        parts = rollout.rewards[..., None] if rollout.reward_parts is None else rollout.reward_parts  # [B,G,K]
        if parts.shape[-1] != len(self.weights):
            raise ValueError(
                f"advantage kvpo: weights={self.weights} name {len(self.weights)} reward columns but the batch has "
                f"{parts.shape[-1]}; give one weight per configured reward (local first, then global)"
            )
        return parts.double()

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        parts = self._columns(rollout)  # [B,G,K]
        valid = rollout.group_valid.bool()  # [B,G]
        anchor = rollout.flag(ANCHOR) & valid  # [B,G]
        anchor_ok = anchor & torch.isfinite(parts).all(-1)  # [B,G]
        bad = (anchor_ok.sum(1) != 1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"advantage kvpo: groups {bad} do not hold exactly one valid anchor row (row flag {ANCHOR!r}) with "
                "finite rewards; use the rollout strategy kv_branches (one anchor and K routed branches per prompt)"
            )
        branches = valid & ~anchor  # [B,G]
        total = torch.zeros(valid.shape, dtype=torch.float64)  # [B,G]
        for k, w in enumerate(self.weights):
            seen = branches & torch.isfinite(parts[..., k])  # [B,G]
            a = anchor_advantages(torch.nan_to_num(parts[..., k]), seen, anchor_ok, self.eps)  # [B,G]
            if self.fusion == "std":
                std = population_std(a, seen)  # [B,1]
                a = torch.where(std > 1e-8, a / std.clamp(min=1e-8), a)  # [B,G] no division by a vanishing std
            total = total + w * a  # [B,G]
        total = total.clamp(-self.adv_clip, self.adv_clip)  # [B,G]
        return to_float32(torch.where(branches, total, torch.zeros((), dtype=total.dtype)))  # [B,G]
