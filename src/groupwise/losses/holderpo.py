"""HölderPO: a Hölder (power) mean of order p of the token ratios, clipped per sequence, p annealed.

"Hölder Policy Optimisation", Chen, Liang, Chen, Gong, Le, Wang, Zhu, Yang, Lin, Zhang, Wang
(UCL / SJTU / HKUST-GZ), 2026. https://arxiv.org/abs/2605.12058 — authors' code
github.com/YihangChen9/HolderPO (``train_zero_math_holder.py``, ``scripts/qwen2.5-math-7b-holder.sh``).
Spec: specs/30.

**Change vs GRPO**

- One importance ratio per sequence: the power mean of order p of its token ratios (p = 1 the
  arithmetic mean, p → 0 the geometric mean = GSPO's ratio, p = −1 the harmonic mean), clipped per
  sequence with PPO's ε instead of per token.
- p follows a schedule, from +2 (gradient concentrated on high-ratio tokens: fast early learning)
  to −2 (flattened: low variance late): give ``p`` as a schedule table (``schedules/standard.py``).

**Math** (``d = logp − logp_old`` per token, ``mask`` = loss tokens, ``L = Σ_t mask``)::

    log_rho = (1/p) · log( Σ_t mask·exp(p·d) / L )            p ≠ 0   (|p| >= 1e-6)
            = Σ_t mask·d / L                                   p = 0   (GSPO's seq_log_ratio)
    rho     = exp(log_rho)                                     # [b,G]
    adv     = Σ_t mask·adv_t / L                               # [b,G]
    loss    = max(−adv·rho, −adv·clip(rho, 1 − eps_low, 1 + eps_high))        # [b,G] a row loss
    sequence_w_clip: d clipped to [−log(1 + eps_low), log(1 + eps_high)] first, then as above
    holder_token:    rho = M_p(min(r_t, 1 + eps_high)) if adv > 0, M_p(max(r_t, 1 − eps_low)) if adv < 0
                     loss = −adv·rho                      (r_t = exp(d), M_p the power mean)

Gradient: ∂rho/∂d_t = rho·w_t with w_t = mask·exp(p·d_t) / Σ_t mask·exp(p·d) (= the spec's
ρ^{1−p}·r_t^p / L): the tokens' weights are the softmax of p·d over the row, concentrated on
high-ratio tokens for p > 0, uniform at p = 0, on low-ratio tokens for p < 0.

**Defaults**

- ``eps_low = eps_high = 0.2`` [CODE] ``scripts/qwen2.5-math-7b-holder.sh`` (one ε, both sides).
- ``p = 2.0`` [CODE] the released schedule's value at step 0. The released math run anneals it,
  ``linear_dec`` from p_max = 2 to p_min = −2 over S = 500 steps: build with
  ``p = {schedule = "linear", start_value = 2.0, end = -2.0, steps = 500}`` (the recipe spans the
  run instead, ``steps = 0`` [INFERRED]). ``P_KINDS`` maps the code's nine schedule kinds to the
  general schedules; :func:`holder_p_schedule` evaluates them.
- ``variant = "sequence"`` [CODE] the released run; ``"sequence_w_clip"`` and ``"holder_token"``
  are the code's other two modes [CODE]. Asymmetric ``eps_low`` ≠ ``eps_high`` is an option
  [INFERRED] (the code has one ε).
- Aggregation: ``agg = "seq_mean_token_mean"`` (the project default; a row value is its own mean)
  gives the code's mean over sequences [CODE].

**Notes**

1. Row-level term: returns [b,G]. ``|p| < 1e-6`` is the geometric mean exactly (the code's switch).
2. Stable power mean: ``log_rho = d* + log1p(mean_t expm1(p·(d − d*))) / p`` with ``d*`` the
   (detached) token where p·d is largest — no overflow for any |p·d| and no cancellation as p → 0.
3. On-policy d = 0: rho = 1, w_t = 1/L, so ∇loss = −adv·mean_t ∇logp_t, the REINFORCE gradient of
   a row mean, equal to the token REINFORCE gradient under every built-in aggregation.
4. ``d`` and the advantages are zeroed outside the mask first; a row without loss tokens has
   rho = 1 and adv = 0 (loss 0, and the aggregation drops it). Token advantages are reduced to
   their row mean (as ``gmpo``).
5. The clip interval is closed: a rho exactly on 1 ± eps keeps its gradient (``clipped_surrogate``).
6. Statistics: ``ratio`` (rho per row); ``clip_low`` (adv < 0, rho < 1 − eps_low) and ``clip_high``
   (adv > 0, rho > 1 + eps_high) per row — with ``holder_token`` per token: the tokens whose ratio
   the min / max caps (they get no gradient).
7. Token weights: none (``token_weights = "none"``; objective.py): the authors' code applies no
   token weight and none of its reductions to a row factor is sourced (GMPO's geometric mean is
   verl's choice for a different ratio), so a token weight is refused at build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import check_clip, clipped_surrogate, loss_tokens, required, row_advantages
from groupwise.losses.gspo import seq_log_ratio
from groupwise.masked import masked_input, masked_mean
from groupwise.registry import build, register
from groupwise.types import Rollout, StepInfo

VARIANTS = ("sequence", "sequence_w_clip", "holder_token")
P_ZERO = 1e-6  # |p| below this is the geometric mean [CODE]

# the code's schedule kinds of p as general schedules: (schedule, increasing?, extra parameters)
P_KINDS = {
    "constant": ("constant", None, {}),
    "linear": ("linear", True, {}),
    "linear_dec": ("linear", False, {}),
    "sin": ("cosine", True, {}),  # mid − amp·cos(πu)
    "cos": ("cosine", False, {}),  # mid + amp·cos(πu)
    "quad": ("polynomial", True, {}),  # p_min + (p_max − p_min)·u^n
    "quad_dec": ("polynomial", False, {}),
    "cubic": ("polynomial", True, {"power": 3.0, "centered": True}),  # mid + amp·(2u − 1)^3
    "cubic_dec": ("polynomial", False, {"power": 3.0, "centered": True}),
}


def holder_p_table(kind: str, p_min: float = -2.0, p_max: float = 2.0, steps: int = 500, power: float = 2.0) -> dict:
    """The schedule table of HölderPO's p for one of the code's kinds (``p = <table>`` in a recipe)."""
    if kind not in P_KINDS:
        raise ValueError(f"holderpo: p schedule kind must be one of {', '.join(P_KINDS)}, got {kind!r}")
    name, up, extra = P_KINDS[kind]
    if up is None:
        return {"schedule": name, "value": p_max}
    lo, hi = (p_min, p_max) if up else (p_max, p_min)
    table = {"schedule": name, "start_value": lo, "end": hi, "steps": steps, **extra}
    if name == "polynomial" and "power" not in extra:
        table["power"] = power
    return table


def holder_p_schedule(
    step: int, kind: str, p_min: float = -2.0, p_max: float = 2.0, steps: int = 500, power: float = 2.0
) -> float:
    """p at ``step`` (spec interface): progress u = min(1, step / steps) through the kind's shape."""
    table = holder_p_table(kind, p_min, p_max, steps, power)
    schedule = build("schedule", table.pop("schedule"), **table)
    return float(schedule(StepInfo(step=step, seed=0, max_new_tokens=0, total_steps=steps)))


def log_power_mean(d: Tensor, mask: Tensor, p: float) -> Tensor:
    """[b,G] log of the order-p power mean over ``mask`` of exp(d): log M_p(exp d), 0 for an empty row."""
    if abs(p) < P_ZERO:
        return seq_log_ratio(d, torch.zeros_like(d), mask)  # [b,G] geometric mean (GSPO)
    x = p * d  # [b,G,T]
    top = torch.where(mask, x, torch.full((), -torch.inf)).amax(-1, keepdim=True).detach()  # [b,G,1]
    top = torch.where(mask.any(-1, keepdim=True), top, torch.zeros(()))  # [b,G,1]
    e = torch.expm1(torch.where(mask, x - top, torch.zeros(())))  # [b,G,T] in [−1, 0]
    return (top[..., 0] + torch.log1p(masked_mean(e, mask, dim=-1))) / p  # [b,G]


def holder_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor, p: float) -> Tensor:
    """[b,G] the power mean of order p of the token ratios exp(logp − logp_old) over ``mask``."""
    return torch.exp(log_power_mean(logp - logp_old, mask, p))  # [b,G]


def holder_po_loss(
    logp: Tensor,
    logp_old: Tensor,
    mask: Tensor,
    adv: Tensor,
    p: float,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    variant: str = "sequence",
) -> tuple[Tensor, Tensor]:
    """(row loss [b,G], rho [b,G]) of HölderPO; ``adv`` [b,G] sequence advantages, inputs zero-safe outside ``mask``."""
    d = logp - logp_old  # [b,G,T]
    if variant == "holder_token":
        # [b,G,T] min/max(r_t, clip(r_t))
        d = torch.where(adv[..., None] > 0, d.clamp(max=math.log1p(eps_high)), d.clamp(min=math.log1p(-eps_low)))
        rho = torch.exp(log_power_mean(d, mask, p))  # [b,G]
        return -adv * rho, rho  # [b,G]
    if variant == "sequence_w_clip":
        d = d.clamp(-math.log1p(eps_low), math.log1p(eps_high))  # [b,G,T]
    rho = torch.exp(log_power_mean(d, mask, p))  # [b,G]
    return clipped_surrogate(rho, adv, eps_low, eps_high), rho  # [b,G]


@register("objective", "holderpo")
@dataclass
class HolderPO:
    """Power mean of order p of the token ratios, clipped per sequence, p scheduled (HölderPO, Chen et al. 2026)."""

    p: float = 2.0
    eps_low: float = 0.2
    eps_high: float = 0.2
    variant: str = "sequence"
    coef: float = 1.0
    agg: str | None = None

    needs = ()
    token_weights = "none"  # Note 7
    token_weights_reason = "one power-mean ratio per sequence, and no sourced reduction of token weights to it"

    def __post_init__(self) -> None:
        check_clip("holderpo", self.eps_low, self.eps_high)
        if not math.isfinite(self.p):
            raise ValueError(f"holderpo: p must be a finite order (the paper anneals it from 2 to -2), got {self.p}")
        if self.variant not in VARIANTS:
            raise ValueError(f"holderpo: variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")

    def _inputs(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mask = loss_tokens(mb)  # [b,G,T]
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        logp_old = masked_input(required(mb, "logp_old", "holderpo"), mask)  # [b,G,T]
        return logp, logp_old, mask, row_advantages(mb, mask, "holderpo")  # [b,G,T] x3, [b,G]

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        logp, logp_old, mask, adv = self._inputs(mb, out)
        return holder_po_loss(logp, logp_old, mask, adv, self.p, self.eps_low, self.eps_high, self.variant)[0]  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        logp, logp_old, mask, adv = self._inputs(mb, {"logp": out["logp"].detach()})
        _, rho = holder_po_loss(logp, logp_old, mask, adv, self.p, self.eps_low, self.eps_high, self.variant)  # [b,G]
        if self.variant == "holder_token":
            d, a = logp - logp_old, adv[..., None]  # [b,G,T], [b,G,1]
            return {
                "ratio": rho,
                "clip_low": ((d < math.log1p(-self.eps_low)) & (a < 0) & mask).float(),  # [b,G,T]
                "clip_high": ((d > math.log1p(self.eps_high)) & (a > 0) & mask).float(),
            }  # [b,G,T]
        return {
            "ratio": rho,
            "clip_low": ((rho < 1.0 - self.eps_low) & (adv < 0)).float(),  # [b,G]
            "clip_high": ((rho > 1.0 + self.eps_high) & (adv > 0)).float(),
        }  # [b,G]
