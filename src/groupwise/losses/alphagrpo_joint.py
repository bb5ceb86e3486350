"""AlphaGRPO's joint text + image loss: a clipped surrogate on a unified model's think tokens and a
Flow-GRPO clipped surrogate on its denoising steps, one shared advantage.

"AlphaGRPO: GRPO over a unified AR+diffusion model with decompositional verifiable reward",
Huang, Wu, Yang, Liu, Zhao (ICML 2026), https://arxiv.org/abs/2605.12495 — spec 27 ("Loss"; the
authors' ``algorithms/grpo.py``, read for the spec; our code).

**Change vs GRPO**: the row's positions are of two kinds (the token extra ``image_token`` [B,G,T],
1 at flow steps, written by the ``unified`` policy, or ``part``, the planner kind's: Note 4): text
positions get GRPO-SURR with the text clip range, image positions Flow-GRPO's per-step surrogate with
its own clip range and the advantage clipped to ±``adv_clip_max``. Without the extra every position is
text (this is then ``ppo_clip``).

**Math** (``ratio = exp(logp − logp_old)``, ``A`` the shared advantage broadcast to [b,G,T])::

    text  (image_token = 0):  −min(ratio·A, clip(ratio, 1 − text_eps_low, 1 + text_eps_high)·A)
    image (image_token = 1):  A' = clip(A, −adv_clip_max, adv_clip_max)
                              −min(ratio·A', clip(ratio, 1 − img_eps, 1 + img_eps)·A')
                              (= max(−A'·ratio, −A'·clip(ratio)) as the authors write it)

``joint_text_image_loss(text_logp, text_old, text_mask, img_step_logp, img_old_step_logp, adv)`` is
the same two parts on separate tensors (spec 27's interface), token-mean over each part, summed.

**Defaults**

- ``text_eps_low = text_eps_high = 0.2`` [INFERRED] (the authors' ``text_clip_range`` /
  ``text_clip_range_high`` values were not read); ``img_eps = 1e-3`` [INFERRED] the toy's Flow-GRPO
  clip as recipe ``flash_grpo``; ``adv_clip_max = 5.0`` [INFERRED] Flow-GRPO's default.

**Notes**

1. Masked positions are exactly 0 (``ratio_and_adv`` zeroes them); aggregation is the objective's.
2. On-policy the gradient is −A·∇logp on text positions and −A'·∇logp on image ones.
3. ``stats``: ``clip_low`` / ``clip_high`` over both parts with their own ranges, and ``ratio``.
4. The generator positions are read from the token extra ``part`` (the planner kind's: 0 plan, 1
   generator; ``modalities/planner.py``) when a rollout has it, else from ``image_token`` (the
   ``unified`` policy's, and saved rollouts'): the plan's latent actions then take the text clip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import check_clip, clip_stats, clipped_surrogate, ratio_and_adv
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def _image_positions(mb: Rollout, like: Tensor) -> Tensor:
    for name in ("part", "image_token"):  # Note 4
        if name in mb.extras:
            return mb.extras[name].bool()  # [b,G,T]
    return torch.zeros_like(like, dtype=torch.bool)  # [b,G,T] no image part: every position is text


def joint_text_image_loss(
    text_logp: Tensor,
    text_old: Tensor,
    text_mask: Tensor,
    img_step_logp: Tensor,
    img_old_step_logp: Tensor,
    adv: Tensor,
    text_eps: tuple[float, float] = (0.2, 0.2),
    img_eps: float = 1e-3,
    adv_clip_max: float = 5.0,
) -> Tensor:
    """Scalar: token-mean text surrogate ([N,Tt] log-probs, mask) + mean image
    surrogate ([N,K] step log-probs); ``adv`` [N]."""
    m = text_mask.bool()  # [N,Tt]
    ratio_t = torch.exp(torch.where(m, text_logp - text_old, torch.zeros(())))  # [N,Tt]
    text = clipped_surrogate(ratio_t, adv[:, None].expand_as(ratio_t), *text_eps)  # [N,Tt]
    text_loss = (text * m).sum() / m.sum().clamp(min=1)
    a = adv.clamp(-adv_clip_max, adv_clip_max)[:, None].expand_as(img_step_logp)  # [N,K]
    img = clipped_surrogate(torch.exp(img_step_logp - img_old_step_logp), a, img_eps, img_eps)  # [N,K]
    return text_loss + img.mean()


@register("objective", "alphagrpo_joint")
@dataclass
class AlphaGRPOJoint:
    """Clipped surrogate with a text clip on think tokens and Flow-GRPO's clip + advantage clip on denoising steps
    (AlphaGRPO)."""

    text_eps_low: float = 0.2
    text_eps_high: float = 0.2
    img_eps: float = 1e-3
    adv_clip_max: float = 5.0
    coef: float = 1.0
    agg: str | None = None

    needs = ()

    def __post_init__(self) -> None:
        check_clip("alphagrpo_joint", self.text_eps_low, self.text_eps_high)
        check_clip("alphagrpo_joint", self.img_eps, self.img_eps)
        if not self.adv_clip_max > 0:
            raise ValueError(f"alphagrpo_joint: adv_clip_max={self.adv_clip_max} must be > 0")

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        ratio, adv = ratio_and_adv(mb, out, "alphagrpo_joint")  # [b,G,T], [b,G,T]
        image = _image_positions(mb, ratio)  # [b,G,T]
        text = clipped_surrogate(ratio, adv, self.text_eps_low, self.text_eps_high)  # [b,G,T]
        # [b,G,T]
        img = clipped_surrogate(ratio, adv.clamp(-self.adv_clip_max, self.adv_clip_max), self.img_eps, self.img_eps)
        return torch.where(image, img, text)  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv = ratio_and_adv(mb, out, "alphagrpo_joint")  # [b,G,T], [b,G,T]
        image = _image_positions(mb, ratio)  # [b,G,T]
        text = clip_stats(ratio, adv, self.text_eps_low, self.text_eps_high)
        img = clip_stats(ratio, adv, self.img_eps, self.img_eps)
        return {k: torch.where(image, img[k], text[k]) for k in text}
