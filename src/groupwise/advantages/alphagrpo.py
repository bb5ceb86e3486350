"""AlphaGRPO's advantage: per-prompt normalisation with an optional stage-1 baseline, and False
Positive Rectification (FPR) of refinement rewards.

"AlphaGRPO: GRPO over a unified AR+diffusion model with decompositional verifiable reward",
Huang, Wu, Yang, Liu, Zhao (ICML 2026), https://arxiv.org/abs/2605.12495 — spec 27 (the authors'
``compute_advantages``, ``stat_tracking`` and ``reward_postprocess``, read for the spec; our code).

**Change vs GRPO**

- Statistics are per *prompt* (every row of every group with the same dataset prompt, the authors'
  per-prompt stat tracker) with the population std (``np.std``, ddof 0).
- ``baseline = "group_mean"``: the baseline is a given stage-1 reward instead of the rows' mean
  (in the reflection task: the reward of the image being refined); ``"grpo_anchor"``: the baseline
  is ``max(stage-1 reward, mean)`` and the scale the root mean square of the differences.
- ``fpr = true``: a refinement that did not beat the image it refined gets the group's worst
  stage-1 reward, so a "copy the input" refinement is never rewarded (negative advantage).

**Math** (rows ``i`` of one prompt ``p``; ``r`` rewards, ``s`` the stage-1 reward of each row)::

    FPR:          r_i := min_{j ∈ group(i)} s_j    if r_i ≤ s_i        (fpr = true; else r_i unchanged)
    "group":      A_i = (r_i − mean_p r) / (std_p r + eps)                  std with ddof 0
    "group_mean": A_i = (r_i − m_p) / (std_p r + eps)                       m_p = mean_{i ∈ p} s_i
    "grpo_anchor": d_i = r_i − max(m_p, mean_p r);  A_i = d_i / sqrt(mean_p d² + 1e-8)

``fpr_rewards(refined, init)`` and ``per_prompt_advantages(rewards, prompt_ids, group_mean, kind)``
are the two steps as functions (spec 27's interface).

**Defaults**

- ``baseline = "group"`` [CODE] the tracker's default (no stage-1 override).
- ``fpr = false`` [INFERRED] FPR needs the reflection rollout's stage-1 rewards (the extra
  ``stage1_reward``), which only a reflection strategy collects; on by the paper in that task [CODE].
- ``eps = 1e-4`` [CODE] ``std + 1e-4``; the anchor's ``1e-8`` [CODE] is fixed.
- ``by = "prompt"`` [CODE] the per-prompt tracker pools groups of the same prompt; ``"group"``
  [INFERRED] keeps each group apart (the usual GRPO group).
- ``stage1 = "stage1_reward"`` [INFERRED] the name of the group-level extra [B] holding the stage-1
  reward (one refined image per prompt: the same value for every row of the group).

**Notes**

1. Invalid rows (``group_valid`` False or a NaN/inf reward) get exactly 0 and enter no statistic.
2. ``"group"``: a prompt whose valid rewards are all equal (one valid row included) gets exactly 0.
   ``"group_mean"`` keeps the authors' rule: with a constant prompt the std is 0 and the advantage is
   ``(r − m)/eps`` — large when the rows all differ from the stage-1 reward (the sign is what matters);
   ``"grpo_anchor"``'s scale is never below 1e-4.
3. FPR on a group where no row improved makes every reward the group's worst stage-1 reward: a
   constant group, advantage 0 — the group-level form of the paper's "skip the step if no
   refinement improved".
4. ``rollout_extras`` lists ``stage1`` only when ``fpr`` or a stage-1 baseline needs it, so the
   default runs on any rollout; a missing extra is then a ValueError naming it.
5. Whole-batch scope (``by = "prompt"`` pools groups across ranks): the trainer hands every
   estimator the step's whole batch, so the advantages do not depend on the world size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from groupwise.masked import to_float32, valid_rows
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

KINDS = ("group", "group_mean", "grpo_anchor")


def fpr_rewards(refined: Tensor, init: Tensor) -> Tensor:
    """[B,G]: a refinement reward that does not exceed its initial reward becomes the group's lowest initial reward."""
    refined = refined.double()  # [B,G]
    init = init.double().expand_as(refined)  # [B,G] ([B,1] broadcasts)
    worst = init.amin(1, keepdim=True).expand_as(refined)  # [B,G]
    return torch.where(refined <= init, worst, refined)  # [B,G]


def per_prompt_advantages(
    rewards: Tensor,
    prompt_ids: Sequence[Any],
    group_mean: Mapping[Any, float] | None = None,
    kind: str = "group",
    eps: float = 1e-4,
    valid: Tensor | None = None,
) -> Tensor:
    """[N] float64 advantages of flat rewards, normalised per prompt id (module Math); invalid rows 0."""
    if kind not in KINDS:
        raise ValueError(f"per_prompt_advantages: kind={kind!r}; kinds: {', '.join(KINDS)}")
    r = rewards.double().reshape(-1)  # [N]
    ok = torch.isfinite(r) if valid is None else valid.reshape(-1).bool() & torch.isfinite(r)  # [N]
    codes: dict[Any, int] = {}
    # [N] prompt code of each row
    inv = torch.tensor([codes.setdefault(p, len(codes)) for p in prompt_ids], dtype=torch.long)
    K = len(codes)
    x = torch.where(ok, r, torch.zeros((), dtype=r.dtype))  # [N]

    def per_prompt_sum(values: Tensor) -> Tensor:
        return torch.zeros(K, dtype=r.dtype).index_add_(0, inv, values)  # [K]

    count = per_prompt_sum(ok.double())  # [K]
    mean = per_prompt_sum(x) / count.clamp(min=1)  # [K]
    dev = torch.where(ok, r - mean[inv], torch.zeros((), dtype=r.dtype))  # [N]
    std = (per_prompt_sum(dev * dev) / count.clamp(min=1)).sqrt()  # [K] population std of each prompt's valid rows
    if kind == "group":
        high = torch.full((K,), -torch.inf, dtype=r.dtype).scatter_reduce_(
            0, inv, torch.where(ok, r, -torch.inf), "amax"
        )  # [K]
        # [K]
        low = torch.full((K,), torch.inf, dtype=r.dtype).scatter_reduce_(0, inv, torch.where(ok, r, torch.inf), "amin")
        constant = high == low  # [K] Note 2: a constant prompt gets exactly 0
        out = (r - mean[inv]) / (std[inv] + eps)  # [N]
        return torch.where(ok & ~constant[inv], out, torch.zeros((), dtype=r.dtype))  # [N]
    order = list(codes)
    missing = [pid for pid, k in codes.items() if count[k] > 0 and (group_mean is None or pid not in group_mean)]
    if missing:
        raise ValueError(f"per_prompt_advantages: kind={kind!r} needs group_mean for prompt {missing[0]!r}")
    m = torch.tensor(
        [float(group_mean[pid]) if group_mean and pid in group_mean else 0.0 for pid in order], dtype=r.dtype
    )  # [K]
    if kind == "group_mean":
        out = (r - m[inv]) / (std[inv] + eps)  # [N]
    else:
        d = torch.where(ok, r - torch.maximum(m, mean)[inv], torch.zeros((), dtype=r.dtype))  # [N]
        out = d / torch.sqrt(per_prompt_sum(d * d) / count.clamp(min=1) + 1e-8)[inv]  # [N]
    out = torch.where(ok, out, torch.zeros((), dtype=r.dtype))  # [N]
    return out


@register("advantage", "alphagrpo")
@dataclass
class AlphaGRPOAdvantage:
    """Per-prompt (r − baseline)/(std + eps), baseline the mean, a stage-1 reward or their max; optional FPR (AlphaGRPO,
    spec 27)."""

    group_relative = True
    rollout_extras = ()  # (the instance's: ``stage1`` when fpr or a stage-1 baseline reads it, Note 4)
    baseline: str = "group"
    fpr: bool = False
    by: str = "prompt"
    eps: float = 1e-4
    stage1: str = "stage1_reward"

    def __post_init__(self) -> None:
        if self.baseline not in KINDS:
            raise ValueError(f"alphagrpo: baseline={self.baseline!r}; use one of {', '.join(KINDS)}")
        if self.by not in ("prompt", "group"):
            raise ValueError(f"alphagrpo: by={self.by!r}; use 'prompt' (the per-prompt tracker) or 'group'")
        if not self.eps > 0:
            raise ValueError(f"alphagrpo: eps={self.eps} must be > 0 (the std may be 0)")
        self.rollout_extras = (self.stage1,) if self.fpr or self.baseline != "group" else ()

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        r, valid = valid_rows(rollout)  # [B,G] float64, [B,G]
        B, G = r.shape
        s = None
        if self.rollout_extras:
            if self.stage1 not in rollout.extras:
                raise ValueError(
                    f"alphagrpo: fpr / baseline={self.baseline!r} read the extra {self.stage1!r} (the "
                    "stage-1 reward per group), which this rollout lacks; a reflection rollout collects it"
                )
            s = rollout.extras[self.stage1].double().reshape(B, -1).expand(B, G)  # [B,G]
        if self.fpr:
            r = torch.where(valid, fpr_rewards(torch.where(valid, r, torch.zeros(())), s), r)  # [B,G]
        keys = rollout.prompt_index.tolist() if self.by == "prompt" else list(range(B))  # [B]
        ids = [keys[b] for b in range(B) for _ in range(G)]  # [B*G]
        gm = None
        if s is not None and self.baseline != "group":
            gm = {k: float(s[[b for b in range(B) if keys[b] == k]].mean()) for k in dict.fromkeys(keys)}
        # [B,G]
        adv = per_prompt_advantages(r.reshape(-1), ids, gm, self.baseline, self.eps, valid.reshape(-1)).reshape(B, G)
        return to_float32(torch.where(valid, adv, torch.zeros((), dtype=adv.dtype)))  # [B,G]
