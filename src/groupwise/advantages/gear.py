"""GEAR: token/segment advantage reweighting from divergence spikes against a ground-truth self-teacher.

"GEAR: Granularity-Adaptive Advantage Reweighting for LLM Agents via Self-Distillation", Li, Huang,
Liu, Li, Fu, Zhao, Bian, Zhang, Zhang, Wang (Microsoft Research Asia), 2026.
https://arxiv.org/abs/2605.11853 (spec: specs/32; abstract + summary only, no code).

**Change vs GRPO**

- A shaper after the estimator: the sequence advantage A_i becomes a token advantage A_i·w_t.
- w_t compares each token's distribution with the same model conditioned on the ground truth
  (view ``ground_truth``); divergence spikes open segments that share the spike's weight.

**Math** (per sequence, over its valid tokens; ``d`` [N,T] divergence, ``H`` [N,T] entropy)::

    d_t      = KL(π(·|x, y_<t) ‖ π(·|x_T, y_<t))          (divergence="sampled_gap": logp − logp_T)
    z_t      = (d_t − μ_d) / σ_d                            (population σ; z = 0 when σ_d = 0)
    spike_t  = z_t ≥ kappa;   boundary_t = H_t ≥ h_tau      (h_tau = batch quantile h_quantile of H)
    anchor_t = t0 if a spike t0 ≤ t opened a segment not yet ended by a boundary or spike, else t
    z*_t     = z_{anchor_t};   sgn_i = +1 if A_i < 0 else −1
    w_t      = clip(1 + alpha · sgn_i · z*_t, w_min, w_max)  (renorm: w / mean_t w)
    adv_t    = A_i · w_t

**Defaults**

- ``divergence="kl"`` full-vocabulary KL [ABSTRACT+SUMMARY]; ``"sampled_gap"`` the spec's option.
- ``kappa=1.0`` [INFERRED]; z-scores within the sequence with population std [INFERRED].
- ``h_tau=None`` → ``h_quantile=0.9`` of the batch's valid-token entropy [INFERRED]; a float fixes it.
- ``alpha=0.5``, ``w_min=0.1``, ``w_max=3.0``, ``renorm=False`` [INFERRED] (spec's forms).
- ``segments=True`` [ABSTRACT]; ``False`` is the spec's token-only ablation.
- ``gap_is_boundary=True`` [INFERRED] a masked gap ends a segment (the agentic end-of-turn rule).
- ``view="ground_truth"`` (``groupwise.views.ground_truth``, its template [INFERRED]).

**Notes**

1. The boundary token ends the segment and keeps its own z (spec unit test: anchor 4 at t=4); a
   token that is both a spike and a boundary is a spike. Spikes/boundaries use ``>=``.
2. A sequence with σ_d = 0 (all divergences equal, or one valid token) gets z = 0, so w = 1.
   Non-finite d or H count as z = 0 / no boundary and do not enter μ_d, σ_d or the quantile.
3. Rows with ``group_valid`` False or a non-finite reward, masked tokens and A_i = 0 get exactly 0.
   A_i·w_t beyond float32's range (huge unscaled advantages) saturates at ±3.4e38.
4. Token advantages [B,G,T] from an earlier shaper are accepted: sgn then follows each token's sign.
5. Anchors are −1 outside the mask; ``gear_weights`` reads the mask from ``anchor >= 0``.
6. Whole-batch scope: the entropy quantile is over every valid token of the step batch.
7. The spec's top-k KL option needs a top-k-with-indices provider and is not offered yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import finite_or_zero, masked_mean, to_float32
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo

_DIVERGENCES = ("kl", "sampled_gap")


def gear_divergence(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
    """[N,T,V] x2 -> [N,T] full-vocabulary KL(student ‖ teacher) per token, 0 outside ``mask``."""
    logp_s = student_logits.float().log_softmax(-1)  # [N,T,V]
    logp_t = teacher_logits.float().log_softmax(-1)  # [N,T,V]
    p_s = logp_s.exp()  # [N,T,V]
    d = torch.where(p_s > 0, p_s * (logp_s - logp_t), torch.zeros((), dtype=p_s.dtype)).sum(-1)  # [N,T] 0·log 0 = 0
    return torch.where(mask.bool(), d, torch.zeros((), dtype=d.dtype))  # [N,T]


def sequence_z(d: Tensor, mask: Tensor) -> Tensor:
    """[N,T] z-scores within each sequence over its finite valid tokens (population std); 0 elsewhere
    and 0 everywhere in a sequence whose valid divergences are all equal."""
    ok = mask.bool() & torch.isfinite(d)  # [N,T]
    x = torch.where(ok, d.float(), torch.zeros((), dtype=torch.float32))  # [N,T]
    mu = masked_mean(x, ok, dim=-1)[:, None]  # [N,1]
    dev = torch.where(ok, x - mu, torch.zeros((), dtype=x.dtype))  # [N,T]
    sigma = ((dev**2).sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp(min=1)).sqrt()  # [N,1]
    hi = torch.where(ok, x, torch.full_like(x, -torch.inf)).amax(-1, keepdim=True)  # [N,1]
    lo = torch.where(ok, x, torch.full_like(x, torch.inf)).amin(-1, keepdim=True)  # [N,1]
    spread = (hi > lo) & (sigma > 0)  # [N,1] False for constant sequences and ≤1 token
    z = dev / torch.where(spread, sigma, torch.ones_like(sigma))  # [N,T]
    return torch.where(ok & spread, z, torch.zeros((), dtype=z.dtype))  # [N,T]


def gear_segments(
    d: Tensor,
    entropy: Tensor,
    mask: Tensor,
    kappa: float = 1.0,
    h_tau: float = float("inf"),
    segments: bool = True,
    gap_is_boundary: bool = True,
) -> Tensor:
    """[N,T] long: the anchor index of each token (its segment's spike, or itself); −1 outside ``mask``."""
    mask = mask.bool()  # [N,T]
    N, T = d.shape
    pos = torch.arange(T).expand(N, T)  # [N,T]
    if not segments:
        return torch.where(mask, pos, torch.full_like(pos, -1))  # [N,T]
    spike = mask & (sequence_z(d, mask) >= kappa)  # [N,T]
    boundary = mask & torch.isfinite(entropy) & (entropy >= h_tau)  # [N,T] (a spike there still opens: see `opened`)
    if gap_is_boundary:
        boundary = boundary | ~mask  # [N,T]
    event = torch.where(spike | boundary, pos, torch.full_like(pos, -1))  # [N,T]
    last = event.cummax(-1).values  # [N,T] latest spike/boundary at or before t
    opened = (last >= 0) & spike.gather(-1, last.clamp(min=0))  # [N,T] inside a spike's segment
    anchor = torch.where(opened, last, pos)  # [N,T]
    return torch.where(mask, anchor, torch.full_like(pos, -1))  # [N,T]


def gear_weights(
    d: Tensor,
    anchor_index: Tensor,
    seq_adv: Tensor,
    alpha: float = 0.5,
    w_min: float = 0.1,
    w_max: float = 3.0,
    renorm: bool = False,
) -> Tensor:
    """[N,T] weights w = clip(1 + alpha·sgn·z*, w_min, w_max); ``seq_adv`` [N] (or [N,T]); 0 outside the mask."""
    mask = anchor_index >= 0  # [N,T]
    z = sequence_z(d, mask)  # [N,T]
    z_star = z.gather(-1, anchor_index.clamp(min=0))  # [N,T]
    adv = seq_adv.float() if seq_adv.dim() == 2 else seq_adv.float()[:, None]  # [N,T] or [N,1]
    sgn = torch.where(adv < 0, 1.0, -1.0)  # [N,T] or [N,1]
    w = (1.0 + alpha * sgn * z_star).clamp(w_min, w_max)  # [N,T]
    if renorm:
        mean = masked_mean(w, mask, dim=-1)[:, None]  # [N,1]
        w = w / torch.where(mean > 0, mean, torch.ones_like(mean))  # [N,T]
    return torch.where(mask, w, torch.zeros((), dtype=w.dtype))  # [N,T]


def entropy_threshold(entropy: Tensor, mask: Tensor, q: float) -> float:
    """The q-quantile (linear interpolation) of the finite entropies under ``mask``; inf when none."""
    values = entropy[mask.bool() & torch.isfinite(entropy)].float()  # [n]
    return float(torch.quantile(values, q)) if values.numel() else float("inf")


def _extra(rollout: Rollout, key: str) -> Tensor:
    if key not in rollout.extras:
        raise ValueError(
            f"gear needs rollout.extras[{key!r}] (declared in gear.needs); extras present: {sorted(rollout.extras)}"
        )
    return rollout.extras[key].float()  # [B,G,T]


@register("advantage", "gear")
@dataclass
class GEAR:
    """Reweight A_i per token/segment by divergence spikes against a ground-truth self-teacher (GEAR, Li et al.
    2026)."""

    divergence: str = "kl"  # "kl" (full vocabulary, Need kl_to(view)) | "sampled_gap" (logp − logp under view)
    view: str = "ground_truth"
    kappa: float = 1.0
    h_tau: float | None = None  # None: the batch's h_quantile of entropy
    h_quantile: float = 0.9
    alpha: float = 0.5
    w_min: float = 0.1
    w_max: float = 3.0
    renorm: bool = False
    segments: bool = True
    gap_is_boundary: bool = True

    shaper = True  # reshapes an estimator's advantages (advantage.shapers), never estimates alone

    def __post_init__(self) -> None:
        if self.divergence not in _DIVERGENCES:
            raise ValueError(f"gear: divergence must be one of {_DIVERGENCES}, got {self.divergence!r}")
        if not 0.0 <= self.h_quantile <= 1.0:
            raise ValueError(f"gear: h_quantile must be in [0, 1], got {self.h_quantile}")
        if not 0.0 <= self.w_min <= self.w_max:
            raise ValueError(f"gear: need 0 <= w_min <= w_max, got w_min={self.w_min}, w_max={self.w_max}")

    @property
    def needs(self) -> tuple[Need, ...]:
        if self.divergence == "kl":
            return (Need(f"kl_to({self.view})"), Need("entropy"))
        return (Need("logp"), Need("logp", view=self.view), Need("entropy"))

    def _token_divergence(self, rollout: Rollout) -> Tensor:
        """[B,G,T] d_t from the provided extras."""
        if self.divergence == "kl":
            return _extra(rollout, Need(f"kl_to({self.view})").key)  # [B,G,T]
        if rollout.logp_old is None:
            raise ValueError("gear divergence='sampled_gap' needs rollout.logp_old (declared Need('logp'))")
        return rollout.logp_old.float() - _extra(rollout, Need("logp", view=self.view).key)  # [B,G,T]

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if rollout.advantages is None:
            raise ValueError(
                "gear is a shaper: configure an advantage estimator before it (rollout.advantages is None)"
            )
        B, G, T = rollout.shape
        adv = finite_or_zero(rollout.advantages.float())  # [B,G] or [B,G,T]
        if adv.shape not in ((B, G), (B, G, T)):
            raise ValueError(f"gear: advantages must be [B,G] or [B,G,T] = {(B, G, T)}, got {tuple(adv.shape)}")
        valid = rollout.group_valid.bool()  # [B,G]
        if rollout.rewards is not None:
            valid = valid & torch.isfinite(rollout.rewards)  # [B,G]
        mask = rollout.mask.bool() & valid[..., None]  # [B,G,T]
        d = self._token_divergence(rollout).reshape(B * G, T)  # [N,T]
        H = _extra(rollout, "entropy").reshape(B * G, T)  # [N,T]
        h_tau = self.h_tau if self.h_tau is not None else entropy_threshold(H, mask.reshape(B * G, T), self.h_quantile)
        # [N,T]
        anchor = gear_segments(d, H, mask.reshape(B * G, T), self.kappa, h_tau, self.segments, self.gap_is_boundary)
        seq_adv = adv.reshape(B * G) if adv.dim() == 2 else adv.reshape(B * G, T)  # [N] or [N,T]
        w = gear_weights(d, anchor, seq_adv, self.alpha, self.w_min, self.w_max, self.renorm)  # [N,T]
        # [N,T] A·w ≤ 3·A can pass 3.4e38
        out = to_float32((seq_adv if seq_adv.dim() == 2 else seq_adv[:, None]).double() * w.double())
        return torch.where(mask, out.reshape(B, G, T), torch.zeros((), dtype=out.dtype))  # [B,G,T]
