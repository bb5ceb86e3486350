"""KVPO's objective: a PPO-clipped contrast over the softmax of the group's branches (a Gibbs surrogate policy).

"KVPO: ODE-native GRPO for streaming autoregressive video via KV-cache semantic exploration",
arXiv 2605.14278, https://arxiv.org/abs/2605.14278 (spec 21); the reference read for the formula is
the authors' trainer, https://github.com/Richard-Zhang-AI/KVPO ``models/longlive/trainer/kvpo.py``
(as quoted by the spec: ``policy_log_prob_mode = per_step``, ``mechanism_2``, ``discrete_kl``).

**Change vs GRPO**: a deterministic (ODE) generator has no sampling log-prob. Each branch row's
``logp`` is instead a per-step *energy* (the ``ar_flow`` policy: the negative squared error between
the branch's own x̂₀ and the model's x̂₀ under the clean cache), and the policy is the Gibbs
distribution over the group's branches, π_θ(g) = softmax_g(s_g) with s_g = Σ_t logp(g, t). The
ratio is one per branch, of those branch probabilities, not of token probabilities.

**Math** (group b; branch rows g = valid rows with a loss token that are not the ``anchor`` row)::

    s_g       = Σ_t logp(g, t)            (the same with logp_old, logp_ref)
    unsafe    = no branch beats the anchor on any reward column: ∀g,k  r_k(g) <= r_k(anchor)
    log π(g)  = s_g − logsumexp([s_1..s_K] (+ [0] when unsafe))     the anchor logit 0
    ρ_g       = exp(clamp(log π_θ(g) − log π_old(g), −20, 20))
    L_pg      = −mean_g min(ρ_g A_g, clip(ρ_g, 1 − eps_low, 1 + eps_high) A_g)
    L         = (unsafe_scale if unsafe else 1) · L_pg + kl_coef · Σ_g π_θ(g) (log π_θ(g) − log π_ref(g))

The KL is over the K-branch softmax (no anchor logit) to the frozen initial generator (``logp_ref``).

**Defaults**

- ``eps_low = 0.1``, ``eps_high = 0.2`` [CODE] the asymmetric clip.
- ``unsafe_scale = 0.5`` [CODE] ``1 − π_anchor`` with π_anchor = 1/2 (the spec's checklist: a constant 0.5).
- ``kl_coef = 10`` [CODE] ``discrete_kl``; 0 turns the reference off (no ``logp_ref`` need).
- ``log_ratio_clip = 20`` [CODE].

**Notes**

1. Group-level term (``couples = "group"``): every row of group b carries L[b]; aggregate with
   ``group_mean`` (the mean over prompts). ``Objective.loss_mask`` drops the anchor row, so the
   group's mean is over its branches, and the anchor's reward is read from the batch here.
2. ``token_weights = "none"``: a softmax over whole branches has no token-weighted form.
3. At θ = old every ratio is exactly 1 (both softmaxes are one computation of the same numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import loss_tokens, required
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import ANCHOR, Need, Rollout, StepInfo


def branch_log_probs(s: Tensor, members: Tensor, anchor_logit: Tensor) -> Tensor:
    """[b,G] log π(g) = s_g − logsumexp over the group's ``members`` [b,G], with an extra logit 0 in groups
    where ``anchor_logit`` [b]; 0 outside the members."""
    neg_inf = torch.full((), -torch.inf, dtype=s.dtype)
    z = torch.where(members, s, neg_inf)  # [b,G]
    extra = torch.where(anchor_logit, torch.zeros((), dtype=s.dtype), neg_inf)[:, None]  # [b,1]
    logits = torch.cat([z, extra], dim=1)  # [b,G+1]
    has = torch.isfinite(logits).any(1, keepdim=True)  # [b,1]
    lse = torch.logsumexp(torch.where(has, logits, torch.zeros((), dtype=s.dtype)), dim=1, keepdim=True)  # [b,1]
    return torch.where(members, s - lse, torch.zeros((), dtype=s.dtype))  # [b,G]


def unsafe_groups(mb: Rollout, branches: Tensor, anchor: Tensor) -> Tensor:
    """[b] bool: no branch beats the group's anchor on any reward column (``reward_parts``, else ``rewards``)."""
    if mb.rewards is None:
        raise ValueError("objective term 'kvpo' needs rollout.rewards (the anchor-safety check reads them)")
    parts = mb.rewards[..., None] if mb.reward_parts is None else mb.reward_parts  # [b,G,K]
    parts = parts.double()
    r_anchor = torch.where(anchor[..., None], parts, torch.zeros((), dtype=parts.dtype)).sum(1, keepdim=True)  # [b,1,K]
    beats = (parts > r_anchor) & branches[..., None]  # [b,G,K] NaN never beats
    return ~beats.any(-1).any(-1)  # [b]


def kvpo_group_loss(
    s: Tensor,
    s_old: Tensor,
    adv: Tensor,
    members: Tensor,
    unsafe: Tensor,
    eps_low: float = 0.1,
    eps_high: float = 0.2,
    unsafe_scale: float = 0.5,
    s_ref: Tensor | None = None,
    kl_coef: float = 0.0,
    log_ratio_clip: float = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """([b] the group losses, statistics) from branch scores ``s``/``s_old``/``s_ref`` [b,G], advantages [b,G],
    ``members`` [b,G] (the branches) and ``unsafe`` [b] (module Math)."""
    lp = branch_log_probs(s, members, unsafe)  # [b,G]
    lp_old = branch_log_probs(s_old.detach(), members, unsafe)  # [b,G]
    log_ratio = (lp - lp_old).clamp(-log_ratio_clip, log_ratio_clip)  # [b,G]
    ratio = torch.exp(torch.where(members, log_ratio, torch.zeros((), dtype=lp.dtype)))  # [b,G]
    adv = torch.where(members, adv.to(lp.dtype), torch.zeros((), dtype=lp.dtype))  # [b,G]
    surr = -torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)  # [b,G]
    n = members.sum(1).clamp(min=1).to(lp.dtype)  # [b]
    pg = torch.where(members, surr, torch.zeros((), dtype=lp.dtype)).sum(1) / n  # [b]
    scale = torch.where(unsafe, torch.full((), unsafe_scale, dtype=lp.dtype), torch.ones((), dtype=lp.dtype))  # [b]
    loss = scale * pg  # [b]
    kl = torch.zeros_like(loss)  # [b]
    if s_ref is not None and kl_coef:
        no_anchor = torch.zeros_like(unsafe)  # [b] the KL is over the K branches only
        lq = branch_log_probs(s, members, no_anchor)  # [b,G]
        lr = branch_log_probs(s_ref.detach(), members, no_anchor)  # [b,G]
        kl = torch.where(members, lq.exp() * (lq - lr), torch.zeros((), dtype=lp.dtype)).sum(1)  # [b]
        loss = loss + kl_coef * kl
    return loss, {"ratio": ratio, "unsafe": unsafe, "kl": kl, "log_pi": lp}


@register("objective", "kvpo")
@dataclass
class KVPOTerm:
    """PPO-clipped contrast over the Gibbs softmax of a group's branches, anchor-safe, with a discrete KL (KVPO)."""

    eps_low: float = 0.1
    eps_high: float = 0.2
    unsafe_scale: float = 0.5
    kl_coef: float = 10.0
    log_ratio_clip: float = 20.0
    coef: float = 1.0
    agg: str | None = "group_mean"

    couples = "group"
    modality = "ar_flow"  # the energies of the ar_flow policy
    token_weights = "none"  # Note 2
    token_weights_reason = "a softmax over whole branches (a Gibbs surrogate policy) has no token-weighted form"

    def __post_init__(self) -> None:
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0 and 0 < self.unsafe_scale <= 1):
            raise ValueError(
                f"kvpo: need 0 <= eps_low < 1, eps_high >= 0, 0 < unsafe_scale <= 1; got {self.eps_low}, "
                f"{self.eps_high}, {self.unsafe_scale}"
            )
        if self.kl_coef < 0 or not self.log_ratio_clip > 0:
            raise ValueError(
                f"kvpo: need kl_coef >= 0 and log_ratio_clip > 0, got {self.kl_coef}, {self.log_ratio_clip}"
            )

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need("logp", model="ref"),) if self.kl_coef else ()

    def _parts(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        who = "kvpo"
        anchor = mb.flag(ANCHOR) & mb.group_valid  # [b,G]
        if not bool(anchor.any(1).all()):
            raise ValueError(
                "objective term 'kvpo' needs one anchor row (row flag 'anchor') in every group; use the rollout "
                "strategy kv_branches"
            )
        mask = loss_tokens(mb) & ~anchor[..., None]  # [b,G,T]
        members = mask.any(-1)  # [b,G] the branches
        if mb.advantages is None:
            raise ValueError("objective term 'kvpo' needs rollout.advantages; configure the advantage estimator kvpo")
        s = masked_input(out["logp"], mask).sum(-1)  # [b,G]
        s_old = masked_input(required(mb, "logp_old", who), mask).sum(-1)  # [b,G]
        s_ref = masked_input(required(mb, "logp_ref", who), mask).sum(-1) if self.kl_coef else None  # [b,G]
        return kvpo_group_loss(
            s,
            s_old,
            mb.advantages.float(),
            members,
            unsafe_groups(mb, members, anchor),
            self.eps_low,
            self.eps_high,
            self.unsafe_scale,
            s_ref,
            self.kl_coef,
            self.log_ratio_clip,
        )

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        loss, _ = self._parts(mb, out)  # [b]
        return loss[:, None].expand(mb.shape[:2])  # [b,G] every row carries its group's loss

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        with torch.no_grad():
            _, st = self._parts(mb, {"logp": out["logp"].detach()})
        G = mb.shape[1]
        return {
            "ratio": st["ratio"],  # [b,G]
            "unsafe": st["unsafe"].float()[:, None].expand(-1, G),  # [b,G]
            "kl": st["kl"][:, None].expand(-1, G),  # [b,G]
        }
