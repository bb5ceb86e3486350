"""CoDistill-GRPO: a small model samples every rollout; it learns with a KD reward from a large
model, and the large model learns from the small model's rollouts with importance weights.

"CoDistill-GRPO: A Co-Distillation Recipe for Efficient Group Relative Policy Optimization",
Soo Min Kwon, Ziteng Sun, Ananda Theertha Suresh, Himanshu Jain, Sanjiv Kumar, 2026.
https://arxiv.org/abs/2605.08873 — spec 44. Only the abstract was available; no code.

**Change vs GRPO**: two policies train at once and only the small one (student, π_s) generates.
The student's reward gains a KD term from the large model (teacher, π_L); the teacher's loss is
GRPO's clipped surrogate on the student's rollouts, re-weighted by a truncated importance weight
π_L,old / π_s. In groupwise: the student is the trainer's policy; the reward ``codistill_kd``
below adds the KD term; the teacher is a role (``roles.teacher``, ``roles.py``) whose objective is
``ppo_clip`` with the weight ``sampler_is(mode="token_truncate", hi=C)`` and the ``token_mean``
aggregation, which is ``codistill_teacher_loss`` (``tests/test_codistill.py`` checks the two
agree); recipe ``codistill``.

**Math** (per completion i and token t; ``mask`` selects the completion tokens)::

    r_kd_i  = mean_t [teacher_logp − student_logp]            (both detached)
    r_i     = r_task_i + lam · r_kd_i                          (student reward)
    w_it    = sg[min(C, exp(teacher_old_logp − student_logp))]         is_level="token"
    w_i     = sg[min(C, exp(mean_t (teacher_old_logp − student_logp)))]  is_level="seq"
    ρ_it    = exp(logp_L − old_logp_L)
    L_L     = −Σ_it w·min(ρ A_i, clip(ρ, 1 − eps, 1 + eps) A_i) / Σ_it mask

**Defaults**

- only the small model samples; the student reward holds an on-policy KD term; the large model
  learns from the small model's rollouts "with importance reweighting" [ABSTRACT].
- KD reward = mean token log-ratio teacher − student (the negative of a per-token reverse-KL
  estimate on the student's own sample), ``lam = 1.0`` [INFERRED].
- truncated decoupled IS weight, ``C = 2.0``, ``is_level = "token"`` [INFERRED]; ``"seq"`` uses the
  geometric-mean sequence ratio [INFERRED].
- ``eps = 0.2`` [INFERRED] PPO's ε; ``A_i`` = the GRPO advantage of the task reward over the
  student's group (the KD term is not used for the teacher) [INFERRED].

**Notes**

1. Every log-prob except ``logp_L`` is detached inside these functions: gradient reaches only
   the teacher's current log-probs, never the weights or the KD reward.
2. Inputs are neutralised outside ``mask`` before any ``exp`` (``masked.masked_input``):
   padding, even NaN, reaches neither a value nor a gradient. A row without tokens gets
   ``r_kd = 0``; with ``is_level="seq"`` its weight is 0.
3. The loss is a token mean over the whole batch (Σ mask, DAPO-style); the weights do not enter
   the normaliser.
4. Any leading shape works ([N,T] or [B,G,T]); ``adv`` has the leading shape (one advantage per
   completion) or the full token shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import check_clip, clipped_surrogate
from groupwise.masked import masked_input, masked_mean, masked_sum
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo

IS_LEVELS = ("token", "seq")


def _mask(mask: Tensor, like: Tensor, who: str) -> Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"{who}: mask must have the log-prob shape {tuple(like.shape)}, got {tuple(mask.shape)}")
    return mask.bool()


def kd_reward(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """r_kd [N] float32: mean over each row's tokens of teacher − student log-prob (no gradient)."""
    m = _mask(mask, student_logp, "kd_reward")  # [N,T]
    diff = masked_input(teacher_logp.detach(), m) - masked_input(student_logp.detach(), m)  # [N,T]
    return masked_mean(diff, m, dim=-1)  # [N]


def codistill_student_rewards(r_task: Tensor, r_kd: Tensor, lam: float = 1.0) -> Tensor:
    """rewards [B,G] float32 = r_task + lam · r_kd (the student's GRPO reward)."""
    if r_task.shape != r_kd.shape:
        raise ValueError(
            f"codistill_student_rewards: r_task {tuple(r_task.shape)} and "
            f"r_kd {tuple(r_kd.shape)} must match; reshape r_kd[N] to [B,G]"
        )
    return r_task.float() + lam * r_kd.detach().float()  # [B,G]


def truncated_is_weights(
    teacher_old_logp: Tensor, student_logp: Tensor, C: float = 2.0, *, mask: Tensor | None = None, level: str = "token"
) -> Tensor:
    """w [N,T] float32 = sg[min(C, π_L,old / π_s)], per token or per sequence (geometric mean); 0 outside ``mask``."""
    if not C > 0:
        raise ValueError(f"truncated_is_weights: C must be > 0 (math.inf for no truncation), got {C}")
    if level not in IS_LEVELS:
        raise ValueError(f"truncated_is_weights: level must be one of {IS_LEVELS}, got {level!r}")
    m = (
        torch.ones_like(student_logp, dtype=torch.bool)
        if mask is None
        else _mask(mask, student_logp, "truncated_is_weights")
    )  # [N,T]
    d = masked_input(teacher_old_logp.detach(), m) - masked_input(student_logp.detach(), m)  # [N,T] log π_L,old/π_s
    if level == "seq":
        d = masked_mean(d, m, dim=-1)[..., None].expand_as(d)  # [N,T] the row's mean log-ratio on every token
    w = torch.exp(d.clamp(max=math.log(C)))  # [N,T]; truncating in log space never overflows
    return torch.where(m, w, torch.zeros((), dtype=w.dtype))  # [N,T]


def _token_adv(adv: Tensor, like: Tensor, m: Tensor) -> Tensor:
    if adv.shape == like.shape[:-1]:
        adv = adv[..., None].expand_as(like)  # [N,T]
    elif adv.shape != like.shape:
        raise ValueError(
            f"codistill_teacher_loss: adv must be {tuple(like.shape[:-1])} "
            f"(per completion) or {tuple(like.shape)}, got {tuple(adv.shape)}"
        )
    return masked_input(adv.detach(), m)  # [N,T]


def codistill_teacher_loss(
    logp_L: Tensor,
    old_logp_L: Tensor,
    student_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps: float = 0.2,
    C: float = 2.0,
    is_level: str = "token",
) -> Tensor:
    """Scalar float32 teacher loss −Σ w·min(ρA, clip(ρ)A) / Σ mask on the student's rollouts."""
    check_clip("codistill_teacher_loss", eps, eps)
    m = _mask(mask, logp_L, "codistill_teacher_loss")  # [N,T]
    ratio = torch.exp(masked_input(logp_L, m) - masked_input(old_logp_L.detach(), m))  # [N,T]
    w = truncated_is_weights(old_logp_L, student_logp, C, mask=m, level=is_level)  # [N,T] no grad
    tok = w * clipped_surrogate(ratio, _token_adv(adv, logp_L, m), eps, eps)  # [N,T]
    return masked_sum(tok, m) / m.sum().clamp(min=1)  # []


def teacher_is_stats(
    teacher_old_logp: Tensor, student_logp: Tensor, mask: Tensor, C: float = 2.0, level: str = "token"
) -> dict[str, float]:
    """Logging: mean weight and the share of loss tokens whose raw weight exceeds C (truncated)."""
    m = _mask(mask, student_logp, "teacher_is_stats")  # [N,T]
    w_raw = truncated_is_weights(teacher_old_logp, student_logp, math.inf, mask=m, level=level)  # [N,T]
    w = truncated_is_weights(teacher_old_logp, student_logp, C, mask=m, level=level)  # [N,T]
    return {
        "is_weight_mean": float(masked_mean(w, m)),
        "is_truncated_frac": float(masked_mean((w_raw > C).float(), m)),
    }


@register("reward", "codistill_kd")
@dataclass
class CoDistillKD:
    """On-policy KD reward mean_t[log π_teacher − log π_student] from a trained role (CoDistill-GRPO, Kwon et al.
    2026)."""

    teacher: str = "teacher"  # the role whose log-probs are the teacher's
    weight: float = 1.0  # λ_kd [INFERRED]

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need("logp"), Need("logp", model=self.teacher))

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        teacher = rollout.extras.get(Need("logp", model=self.teacher).key)
        if teacher is None or rollout.logp_old is None:
            raise ValueError(
                f"codistill_kd needs the policy's and role {self.teacher!r}'s "
                f"log-probs; declare roles.{self.teacher} in the config"
            )
        return kd_reward(rollout.logp_old, teacher, rollout.row_mask)  # [B,G]
