"""HT-GRPO's unmasking-order credit and staged token subsets for a masked-diffusion LM: weight each
canvas token by how early the sampler committed it, and train on all / the early / the late tokens
in three stages.

"Sketch Then Paint: Hierarchical RL for dMLLMs" (HT-GRPO), arXiv 2605.16842, spec 12; the README of
Alpha-VLLM/Lumina-DiMOO ``ht_grpo/README.md`` ("Global: update all visual tokens. Structure: focus on
early tokens for layout, count, and relations. Refinement: polish local details after the structure
is stable"). The paper's formulas were not read: the weight function, the early/late cutoff and the
stage lengths below are the spec's reconstruction [INFERRED].

**Change vs GRPO**: the per-token loss of a masked-diffusion LM (``model.policy = "mdlm"``) is
scaled by a weight that falls with the token's commit step (``ht_hierarchy``), and a stage mask
(``ht_stage``) keeps the early- or late-committed tokens only, for the loss and its normalisers.
The fully-masked ratio of the paper is the kind's ``estimator = "stratified(1)"``.

**Math** (row of L canvas tokens, S sampling steps, o_i = ``commit_step`` ∈ 1..S)::

    ht_hierarchy:  raw_i = 1 + η · (S − o_i) / (S − 1)           (S = 1: raw_i = 1)
                   w_i = raw_i / mean_{j in the row} raw_j                                  # [B,G,T]
    ht_stage:      c = ⌈S · q⌉
                   m_i = 1 (stage 0, global) | 1[o_i ≤ c] (1, structure) | 1[o_i > c] (2, refinement)
    loss (ppo_clip, agg seq_mean_token_mean):  −Σ_i m_i w_i min(ρ_i A, clip(ρ_i) A) / Σ_i m_i  per row

**Defaults** (all [INFERRED] spec 12)

- ``ht_hierarchy``: ``eta = 1.0`` (first-committed tokens weigh 2, last 1, before normalising);
  ``scope = "loss"`` (a weight, never a mask).
- ``ht_stage``: ``stage_id = 0`` (global); schedule it with ``{ schedule = "piecewise", values = [0, 1, 2],
  at = [0.4, 0.7] }`` for the spec's 40 % / 30 % / 30 % phases; ``q = 0.3`` (c = 2 at S = 4);
  ``scope = "token"`` (the masked tokens leave the normalisers: the Σ m in the denominator).

**Notes**

1. Both read the token extra ``commit_step`` [B,G,L] and S from ``q_trace`` [B,G,L,S], written by
   ``MDLMPolicy.generate`` (``modalities/mdlm.py`` Note 2); a rollout without them is a ``ValueError``.
   ``reads_extras`` declares the two, so the build refuses a policy that does not write them.
2. Padding rows and masked-out tokens get 0; the mean of ``ht_hierarchy`` is over each row's masked tokens.
3. Spec 12's test: S = 4, o = [1, 1, 2, 4], η = 1: raw = [2, 2, 5/3, 1], mean 5/3, w = [1.2, 1.2, 1.0, 0.6];
   q = 0.3: c = ⌈1.2⌉ = 2, structure m = [1, 1, 1, 0], refinement m = [0, 0, 0, 1].
4. A scheduled ``stage_id`` arrives as a float (``schedules.resolve``) and is rounded to 0, 1 or 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

STAGES = ("global", "structure", "refinement")


def hierarchical_weights(order: Tensor, mask: Tensor, steps: int, eta: float = 1.0) -> Tensor:
    """[B,G,L] 1 + η(S − o)/(S − 1), normalised to mean 1 over each row's masked tokens; 0 off the mask."""
    raw = 1.0 + eta * (steps - order.double()) / max(steps - 1, 1)  # [B,G,L]
    raw = torch.where(mask, raw, 0.0)  # [B,G,L]
    mean = raw.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)  # [B,G,1]
    return torch.where(mask, raw / mean.clamp_min(1e-12), 0.0)  # [B,G,L]


def stage_mask(order: Tensor, mask: Tensor, steps: int, stage: int, q: float = 0.3) -> Tensor:
    """[B,G,L] 1 on the tokens the stage trains (0 global, 1 structure: o ≤ ⌈Sq⌉, 2 refinement: o > ⌈Sq⌉)."""
    cutoff = math.ceil(round(steps * q, 9))  # round() guards 4 * 0.3 = 1.2000000000000002 style noise
    keep = {0: torch.ones_like(mask), 1: order <= cutoff, 2: order > cutoff}[stage]  # [B,G,L]
    return (mask & keep).double()  # [B,G,L]


def _order(rollout: Rollout, who: str) -> tuple[Tensor, int]:
    missing = [k for k in ("commit_step", "q_trace") if k not in rollout.extras]
    if missing:
        raise ValueError(
            f"{who} needs the token extras {missing}, written by the mdlm policy's sampler (model.policy='mdlm')"
        )
    return rollout.extras["commit_step"], int(rollout.extras["q_trace"].shape[-1])  # [B,G,L], S


@register("weight", "ht_hierarchy")
@dataclass
class HierarchyWeight:
    """HT-GRPO's unmasking-order credit: earlier-committed tokens weigh more, mean 1 per row (spec 12)."""

    eta: float = 1.0  # [INFERRED] spec 12: the first-committed tokens weigh 1 + η before normalising
    scope: str = "loss"  # a weight: every token stays in the normalisers

    needs = ()
    reads_extras = ("commit_step", "q_trace")

    def __post_init__(self) -> None:
        if not self.eta >= 0.0:
            raise ValueError(f"ht_hierarchy: eta must be >= 0 (0 = uniform credit), got {self.eta}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        order, steps = _order(rollout, "ht_hierarchy")
        return hierarchical_weights(order, rollout.row_mask.bool(), steps, self.eta).float()  # [B,G,L]


@register("weight", "ht_stage")
@dataclass
class StageMask:
    """HT-GRPO's staged token subsets: all tokens, the early-committed, or the late-committed (spec 12)."""

    stage_id: float = 0  # the stage: 0 global | 1 structure | 2 refinement; schedule it with "piecewise" (Note 4)
    q: float = 0.3  # [INFERRED] spec 12: the structure tokens are those committed by step ⌈S·q⌉
    scope: str = "token"  # the masked tokens leave the loss and every normaliser (Σ m in the denominator)

    needs = ()
    reads_extras = ("commit_step", "q_trace")

    def __post_init__(self) -> None:
        if round(float(self.stage_id)) not in (0, 1, 2):
            raise ValueError(
                f"ht_stage: stage_id must be 0 (global), 1 (structure) or 2 (refinement), got {self.stage_id}"
            )
        if not 0.0 < self.q < 1.0:
            raise ValueError(f"ht_stage: q must be in (0, 1), got {self.q}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        order, steps = _order(rollout, "ht_stage")
        stage = round(float(self.stage_id))
        if stage not in (0, 1, 2):
            raise ValueError(f"ht_stage: stage_id {self.stage_id} (a schedule's value) is not 0, 1 or 2")
        return stage_mask(order, rollout.row_mask.bool(), steps, stage, self.q).float()  # [B,G,L]
