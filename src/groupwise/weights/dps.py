"""DACA-GRPO's denoising progress scores: weight each canvas token by how long its prediction stayed
uncertain while a masked-diffusion LM sampled it.

"DACA-GRPO: Denoising-Aware Credit Assignment for Reinforcement Learning in Diffusion Language
Models", Karimi Monsefi et al. (OSU, Apple), arXiv 2605.16342, spec 54. No code; the full paper was
not read: the abstract says "per-token importance weights from intermediate predictions at no
additional forward cost", and the formula below is the spec's reading of it [INFERRED].

**Change vs GRPO**: the per-token policy loss of a masked-diffusion LM (``model.policy = "mdlm"``)
is multiplied by a weight of mean 1 per row, larger for tokens the sampler was unsure of for longer.

**Math** (row of L canvas tokens, S sampling steps; from the sampler's token extras: ``commit_step``
τ_i ∈ 1..S and ``q_trace`` q_{i,s} = the step-s probability of the finally committed token)::

    progress (default):  DPS_i = 1 − mean_{s < τ_i} q_{i,s}     (the steps before the commit; none -> 0)
    commit_step:         DPS_i = τ_i / S
    w_i = max(DPS_i, w_min) / mean_{j in the row} max(DPS_j, w_min)                         # [B,G,T]

**Defaults** (all [INFERRED] spec 54)

- ``mode = "progress"``; ``"commit_step"`` is the spec's alternative.
- ``w_min = 0.1``: a token committed at the first step has no history (DPS 0) and keeps a floor.
- ``scope = "loss"``: the weights scale each token's loss and leave the normalisers (``−Σ_i w_i·
  surrogate_i / |y|``, spec 54's loss).

**Notes**

1. Reads the token extras ``commit_step`` and ``q_trace`` that ``MDLMPolicy.generate`` writes
   (``modalities/mdlm.py`` Note 2; ``q_trace`` holds the steps up to and including the commit, and
   the commit step itself is left out here); a rollout without them is a ``ValueError``.
   ``reads_extras`` declares the two, so the build refuses a policy that does not write them.
2. The mean is per row over its masked tokens; padding rows and masked-out tokens get 0.
3. Spec 54's test: a token with trace [0.2, 0.5, 0.9] before its commit has DPS 1 − 0.533333 = 0.466667.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

MODES = ("progress", "commit_step")


def dps_scores(q_trace: Tensor, commit_step: Tensor, mode: str = "progress") -> Tensor:
    """[...,L] the denoising progress score of each token from ``q_trace`` [...,L,S] and ``commit_step`` [...,L]."""
    S = q_trace.shape[-1]
    if mode == "commit_step":
        return commit_step.double() / S
    before = torch.arange(S) < (commit_step[..., None] - 1)  # [...,L,S] the steps before the commit
    q = torch.where(before, q_trace.double().nan_to_num(0.0), 0.0)  # [...,L,S]
    count = before.sum(-1)  # [...,L]
    mean = q.sum(-1) / count.clamp_min(1)  # [...,L]
    return torch.where(count > 0, 1.0 - mean, 0.0)  # [...,L]


def dps_weights(scores: Tensor, mask: Tensor, w_min: float) -> Tensor:
    """[B,G,L] max(DPS, w_min) normalised to mean 1 over each row's masked tokens, 0 off the mask."""
    floored = torch.where(mask, scores.clamp_min(w_min), 0.0)  # [B,G,L]
    mean = floored.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)  # [B,G,1]
    return torch.where(mask, floored / mean.clamp_min(1e-12), 0.0)  # [B,G,L]


@register("weight", "dps")
@dataclass
class DenoisingProgress:
    """DACA-GRPO's denoising progress scores as token weights, mean 1 per row (spec 54, [INFERRED] formula)."""

    mode: str = "progress"  # "progress": 1 − mean pre-commit probability | "commit_step": τ/S
    w_min: float = 0.1  # floor of a score (a token committed at the first step has none)
    scope: str = "loss"  # scale each token's loss; normalisers unchanged (spec 54's −Σ w·surrogate/|y|)

    needs = ()
    reads_extras = ("commit_step", "q_trace")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"dps: mode={self.mode!r} is not one of {MODES}")
        if not 0.0 < self.w_min <= 1.0:
            raise ValueError(f"dps: w_min must be in (0, 1], got {self.w_min}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        missing = [k for k in ("commit_step", "q_trace") if k not in rollout.extras]
        if missing:
            raise ValueError(
                f"dps needs the token extras {missing}, written by the mdlm policy's sampler (model.policy='mdlm')"
            )
        scores = dps_scores(rollout.extras["q_trace"], rollout.extras["commit_step"], self.mode)  # [B,G,L]
        return dps_weights(scores, rollout.row_mask.bool(), self.w_min).float()  # [B,G,L]
