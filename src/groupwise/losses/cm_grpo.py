"""CM-GRPO: group-relative REINFORCE on a consistency model's own sampling kernel, as an x̂₀-space
regression toward an implicit score target.

"RAVEN" (CM-GRPO), arXiv 2605.15190, spec 19; code https://github.com/mvp-ai-lab/RAVEN
(``engines/grpo.py``: the loss; ``common/diffusion/sampler/consistency.py``: the kernel; read for
the formulas, not copied). The kernel is the flow toy's ``sampler = "consistency"``
(``modalities/flow.py`` Note 9): π(x_s | x_t) = N(A(s)·x̂₀_θ(x_t, t), B(s)²·I), A(s) = 1 − s, B(s) = s.

**Change vs GRPO**: no importance ratio and no clip; the policy gradient reaches the net through
the clean-sample prediction x̂₀ of each trained step, not through a log-prob.

**Math** (per trained step; x̂₀ [b,G,T,D] with grad, x_s the stored next sample, mean = A(s)·x̂₀
and std = B(s), both detached; Â the advantage clipped to ±``adv_clip_max``)::

    score_grad = ½·A(s)·(−Â)·(x_s − mean)/std²                  (detached)
    target     = x̂₀.detach() − score_grad
    loss       = scale · mean_d (x̂₀ − target)²
    ∂loss/∂x̂₀  = −scale · Â · A(s)(x_s − mean)/(D·std²) = −scale · Â · ∂ log π_mean/∂x̂₀

so the gradient equals REINFORCE's on the kernel's log-prob averaged over D, times ``scale``
(``tests/test_cm_grpo.py``). The loss *value* is meaningless (it is ``scale·mean_d score_grad²``,
whatever the policy): read the gradient, not the number. The optional KL anchor builds the same
construction with ``kl_score_grad = ½·A(s)·(mean − mean_ref)/std²`` (mean_ref: the reference's
step mean, ``Need("step_mean", model="ref")``), weighted by ``beta``.

**Defaults**

- ``scale = 100`` [CODE] ``policy_loss_scaling``.
- ``adv_clip_max = 5.0`` [CODE] the advantage clamp of the RAVEN trainer.
- ``beta = 0.0`` [CODE] (the anchor off); with β > 0 the term asks for the reference's step mean.

**Notes**

1. Needs the consistency kernel's stored steps (``flow_x_next``, ``flow_sigma_next``; std = s):
   a rollout whose stored std is not its target level s (an Euler SDE step) is a ``ValueError``.
2. On-policy only (one update per batch, as the code's defaults); no correction for stale samples.
3. The loss is per trained step [b,G,T]; the objective's aggregation averages it over the steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import term_mask, token_advantages
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo


def cm_grpo_step_loss(
    x0: Tensor,
    x_s: Tensor,
    s: Tensor,
    adv: Tensor,
    scale: float = 100.0,
    ref_mean: Tensor | None = None,
    beta: float = 0.0,
) -> Tensor:
    """[...] the per-step surrogate for x̂₀ [...,D] (with grad), stored x_s [...,D], target levels
    s [...] (A = 1 − s, std = s) and advantages [...] (already clipped)."""
    A = (1 - s)[..., None]  # [...,1]
    std2 = (s**2)[..., None]  # [...,1]
    mean = A * x0.detach()  # [...,D]
    score_grad = 0.5 * A * (-adv[..., None]) * (x_s - mean) / std2  # [...,D]
    loss = scale * ((x0 - (x0.detach() - score_grad)) ** 2).mean(-1)  # [...]
    if beta:
        kl_grad = 0.5 * A * (mean - ref_mean) / std2  # [...,D]
        loss = loss + beta * ((x0 - (x0.detach() - kl_grad)) ** 2).mean(-1)  # [...]
    return loss


@register("objective", "cm_grpo")
@dataclass
class CMGRPO:
    """REINFORCE on the consistency kernel as an x̂₀ regression (CM-GRPO / RAVEN, spec 19)."""

    scale: float = 100.0
    adv_clip_max: float = 5.0
    beta: float = 0.0
    coef: float = 1.0
    agg: str | None = None

    reads_extras = ("flow_x_next", "flow_sigma_next", "flow_std")  # the stored consistency steps (x̂₀: a need)

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.adv_clip_max <= 0 or self.beta < 0:
            raise ValueError(
                f"cm_grpo: need scale > 0 ({self.scale}), adv_clip_max > 0 ({self.adv_clip_max}), "
                f"beta >= 0 ({self.beta})"
            )

    @property
    def needs(self) -> tuple[Need, ...]:
        anchor = (Need("step_mean", model="ref"),) if self.beta else ()
        return (Need("x0_pred", grad=True), *anchor)

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        if "x0_pred" not in out:
            raise ValueError("cm_grpo needs out['x0_pred'] (the grad Need('x0_pred')); the forward did not return it")
        mask = term_mask(mb)  # [b,G,T]
        x_s, s = mb.extras["flow_x_next"], mb.extras["flow_sigma_next"]  # [b,G,T,D], [b,G,T]
        if not torch.equal(mb.extras["flow_std"][mask], s[mask]):
            raise ValueError(
                "cm_grpo: the stored steps are not the consistency kernel's (std = s); "
                'use model.params.sampler = "consistency"'
            )
        adv = token_advantages(mb, mask, "cm_grpo").clamp(-self.adv_clip_max, self.adv_clip_max)  # [b,G,T]
        s_safe = torch.where(mask, s, torch.ones(()))  # [b,G,T] padding steps get s = 1 (their loss is masked)
        ref = mb.extras.get("ref.step_mean") if self.beta else None  # [b,G,T,D]
        x0 = out["x0_pred"]  # [b,G,T,D]
        loss = cm_grpo_step_loss(x0, x_s, s_safe, adv, self.scale, ref, self.beta)  # [b,G,T]
        return masked_input(loss, mask)  # [b,G,T]
