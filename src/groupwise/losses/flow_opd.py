"""Flow-OPD: on-policy distillation of flow teachers into a flow student with a dense per-step KL
"reward", plus the manifold anchor (MAR) to a task-agnostic model.

"Flow-OPD: On-Policy Distillation for Flow Matching Models", arXiv 2605.08063, spec 45; code read
https://github.com/CostaliyA/Flow-OPD (``scripts/train_sd3_opd_mix.py``: the loss and the routing;
``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``: the SDE step; for the formulas, not copied).
The student samples with the Flow-GRPO SDE kernel (``model.params.noise = "flow_grpo"``,
``modalities/flow.py`` Note 9); each trained step j has the student's mean μ_θ (with grad), the
routed teacher's mean μ_T and the anchor's μ_MAR on the same stored x (frozen roles, each scored by
its own policy: ``Need("step_mean", model=NAME)``), and the step's noise level std_t (``flow_std``).

**Change vs GRPO**: the advantage is not from rewards but the negative KL to a teacher, per step;
rewards are for logging only (give them weight 0).

**Math** [CODE] (per trained step; means [...,D], std_t [...])::

    KL_j  = mean_d (μ_θ − μ_T)² / (2·std_t²)        (divides by std_t², NOT the transition variance std_t²·|dt|)
    A_j   = clamp(kl_scale · KL_j, ±adv_clip_max)  kl_scale = −1; NOT detached by default (detach_advantage)
    ρ     = exp(log p_θ − log p_old)
    L_pg  = max(−A_j·ρ, −A_j·clip(ρ, 1 − ε, 1 + ε))
    L_MAR = β · mean_d (μ_θ − μ_MAR)² / (2·std_t²)
    loss  = L_pg + L_MAR                         (reward_mode = "kl_only")
    loss  = KL_j + L_MAR                         (reward_mode = "gkd": no ratio, no advantage)

Because A_j carries the student's gradient, L_pg back-propagates the analytic KL too (≈ a GKD term);
``detach_advantage = true`` keeps only the ratio's path (the ablation). Spec 45's unit numbers:
μ_θ = [1, 2], μ_T = [0, 0], std_t = 0.5 → KL = 5.0, A = −5, ρ = 1 → L_pg = 5.0; μ_MAR = [1, 1] →
MAR = 0.04·1.0; total 5.04 (``tests/test_flow_opd.py``).

**Routing** [CODE] cycles datasets, one teacher each (``alternate``, ``epochs_per_cycle``);
[INFERRED] here each group is routed by its dataset column ``route_column`` (``task``): its row's
value names the teacher role in ``teachers`` (a simplification of the code's per-cycle routing).

**Defaults** [CODE ``config/grpo.py`` ``mix_opd_8gpu``]: ``clip = 1e-4``, ``adv_clip_max = 5``,
``beta = 0.04``, ``kl_scale = −1``, ``detach_advantage = false``, ``reward_mode = "kl_only"``.

**Notes**

1. Logged (``stats``, averaged over the trained steps): ``opd_kl`` (KL to the routed teacher),
   ``opd_mar`` (the anchor's KL, β not applied; measured whenever ``anchor`` names a role, so β = 0
   logs it too), ``opd_clipped`` (share of steps whose A_j hit the clamp).
2. A group whose ``route_column`` value names no teacher is a ``ValueError`` naming the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from groupwise.losses._common import required, term_mask
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo


def gaussian_mean_kl(mu_a: Tensor, mu_b: Tensor, std: Tensor) -> Tensor:
    """[...] mean_d (μ_a − μ_b)² / (2·std²) for means [...,D] and std [...] (the code's step KL)."""
    return ((mu_a - mu_b) ** 2).mean(-1) / (2 * std**2)  # [...]


def flow_opd_step_loss(
    logp: Tensor,
    logp_old: Tensor,
    mu: Tensor,
    mu_teacher: Tensor,
    std: Tensor,
    mu_anchor: Tensor | None = None,
    beta: float = 0.04,
    clip: float = 1e-4,
    adv_clip_max: float = 5.0,
    kl_scale: float = -1.0,
    detach_advantage: bool = False,
    reward_mode: str = "kl_only",
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss [...], KL_j [...], MAR KL [...] or zeros) per trained step (module docstring)."""
    kl = gaussian_mean_kl(mu, mu_teacher, std)  # [...]
    mar = gaussian_mean_kl(mu, mu_anchor, std) if mu_anchor is not None else torch.zeros_like(kl)  # [...]
    if reward_mode == "gkd":
        return kl + beta * mar, kl, mar
    adv = (kl_scale * (kl.detach() if detach_advantage else kl)).clamp(-adv_clip_max, adv_clip_max)  # [...]
    ratio = torch.exp(logp - logp_old)  # [...]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))  # [...]
    return pg + beta * mar, kl, mar


@register("objective", "flow_opd")
@dataclass
class FlowOPD:
    """Per-step reverse-KL distillation from routed flow teachers with a MAR anchor (Flow-OPD, spec 45)."""

    teachers: dict = field(default_factory=dict)  # route value -> frozen role, e.g. {A = "teacher_a", B = "teacher_b"}
    route_column: str = "task"  # [INFERRED] the dataset column that routes a group to its teacher
    anchor: str = "mar"  # the frozen role of the task-agnostic model (MAR); "" = no anchor
    beta: float = 0.04  # [CODE] train.beta, the MAR weight
    clip: float = 1e-4  # [CODE] clip_range
    adv_clip_max: float = 5.0  # [CODE] adv_clip_max
    kl_scale: float = -1.0  # [CODE] kl_scale: A = kl_scale · KL
    detach_advantage: bool = False  # [CODE] false: the advantage keeps the student's gradient (a GKD term)
    reward_mode: str = "kl_only"  # [CODE] kl_only | gkd
    coef: float = 1.0
    agg: str | None = None

    modality = "flow"  # reads the flow policy's step means and stored SDE steps

    def __post_init__(self) -> None:
        if not self.teachers or not all(isinstance(v, str) and v for v in self.teachers.values()):
            raise ValueError(
                f"flow_opd.teachers must map each {self.route_column!r} value to a frozen role, e.g. "
                f'{{A = "teacher_a", B = "teacher_b"}}; got {self.teachers!r}'
            )
        if self.reward_mode not in ("kl_only", "gkd"):
            raise ValueError(f"flow_opd.reward_mode must be 'kl_only' or 'gkd', got {self.reward_mode!r}")
        if self.beta < 0 or self.clip <= 0 or self.adv_clip_max <= 0 or (self.beta > 0 and not self.anchor):
            raise ValueError(
                f"flow_opd: need beta >= 0 ({self.beta}) with an anchor role when beta > 0 ({self.anchor!r}), "
                f"clip > 0 ({self.clip}), adv_clip_max > 0 ({self.adv_clip_max})"
            )

    @property
    def needs(self) -> tuple[Need, ...]:
        routed = tuple(Need("step_mean", model=name) for name in dict.fromkeys(self.teachers.values()))
        anchor = (Need("step_mean", model=self.anchor),) if self.anchor else ()  # measured even at β = 0
        return (Need("step_mean", grad=True), *routed, *anchor)

    def _teacher_means(self, mb: Rollout) -> Tensor:
        """[b,G,T,D]: each group's routed teacher's step means."""
        rows = []
        for b, meta in enumerate(mb.meta):
            value = str(meta.get(self.route_column, ""))
            if value not in {str(k) for k in self.teachers}:
                raise ValueError(
                    f"flow_opd: a group's {self.route_column!r} is {value!r}, which names no teacher "
                    f"(flow_opd.teachers routes {sorted(map(str, self.teachers))})"
                )
            name = {str(k): v for k, v in self.teachers.items()}[value]
            rows.append(mb.extras[Need("step_mean", model=name).key][b])  # [G,T,D]
        return torch.stack(rows)  # [b,G,T,D]

    def _pieces(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(mask, loss, KL_j, MAR KL), each [b,G,T]."""
        if "step_mean" not in out:
            raise ValueError(
                "flow_opd needs out['step_mean'] (the grad Need('step_mean')); the forward did not return it"
            )
        mask = term_mask(mb)  # [b,G,T]
        std = torch.where(mask, mb.extras["flow_std"], torch.ones(()))  # [b,G,T] padding steps: 1 (masked)
        mu = out["step_mean"]  # [b,G,T,D]
        teacher = self._teacher_means(mb).to(mu.dtype)  # [b,G,T,D]
        anchor = mb.extras[Need("step_mean", model=self.anchor).key].to(mu.dtype) if self.anchor else None
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        logp_old = masked_input(required(mb, "logp_old", "flow_opd"), mask)  # [b,G,T]
        loss, kl, mar = flow_opd_step_loss(
            logp,
            logp_old,
            mu,
            teacher,
            std,
            anchor,
            self.beta,
            self.clip,
            self.adv_clip_max,
            self.kl_scale,
            self.detach_advantage,
            self.reward_mode,
        )  # [b,G,T] each
        return mask, loss, kl, mar

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        mask, loss, _, _ = self._pieces(mb, out)
        return masked_input(loss, mask)  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        mask, _, kl, mar = self._pieces(mb, out)
        return {
            "opd_kl": masked_input(kl.detach(), mask),  # [b,G,T] KL to the routed teacher
            "opd_mar": masked_input(mar.detach(), mask),  # [b,G,T] KL to the anchor (β not applied)
            "opd_clipped": (abs(self.kl_scale) * kl.detach() >= self.adv_clip_max).float() * mask,  # [b,G,T]
        }
