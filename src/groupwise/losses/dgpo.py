"""DGPO: a groupwise margin loss that puts every coherent path above every inconsistent one, plus a
variance regulariser on the coherent paths' scores.

"DGPO: Beyond Pairwise Preferences with Directional Consistent Groupwise Optimization", Deng, Li,
Li, Zhu, Yuan, Guo, Wang, 2026. https://arxiv.org/abs/2605.10863 — specs/40 (abstract and a
secondary summary only: "a margin-based contrastive loss and variance regularization"; no code).
The forward/reverse data is ``tasks/fobar.py``; rollout ``directions`` pools a problem's two
questions into one group.

**Change vs GRPO**

- No advantage and no ratio: the rows of a question group are labelled coherent (a reward above
  the question group's mean: the correct rows of a 0/1 reward) or inconsistent, and every coherent
  row's score must exceed every inconsistent row's by the margin ``gamma`` (a softplus hinge over
  all P × N pairs, not DPO's single pair).
- ``lam_var`` · the variance of the coherent rows' scores keeps all correct paths comparably likely
  (the spec: preserves reasoning diversity).
- Groups: each rollout group (one question and its direction), or, with ``pool_directions``, a
  problem's forward and reverse rows together (rollout ``directions`` puts them in one group).

**Math** (per question group q: its members, rows with a loss token and a finite reward)::

    s_i   = beta * Σ_t mask·logp / Σ_t mask                         score = "logp"         [b,G]
    s_i   = beta * Σ_t mask·(logp − logp_ref) / Σ_t mask            score = "ref"          [b,G]
    P_q   = {i ∈ q : Σ_{j∈q} (reward_i − reward_j) > 0}  (above q's mean),  N_q = q \\ P_q
            (positive_at = c: P_q = {i ∈ q : reward_i ≥ c})
    L_q   = mean_{p∈P_q, n∈N_q} softplus(−(s_p − s_n − gamma)) + lam_var · Var_{p∈P_q}(s_p)   (population variance)
    L_q   = 0                                                         when P_q or N_q is empty
    loss  = mean over the question groups with a member of L_q     (agg "group_mean", Note 3)

**Defaults**

- ``beta = 1``, ``gamma = 0.2``, ``lam_var = 1`` [INFERRED] spec 40's defaults.
- ``score = "logp"`` [INFERRED] the spec's length-normalised log-likelihood; ``"ref"`` [INFERRED]
  the spec's DPO-style option, the length-normalised log-ratio to the reference (needs ``logp_ref``).
- ``pool_directions = False`` [INFERRED]: groups as sampled; ``True`` [ABSTRACT] ("group forward QA
  and constructed reverse QA candidates for the same problem") pools the directions of a group
  (needs rollout ``directions``, checked at build).
- ``positive_at = None`` [INFERRED]: a row is coherent when its reward is above its question group's
  mean — for a 0/1 correctness reward exactly the correct rows of a mixed group (and no term in an
  all-correct or all-wrong group), for any other reward a relative label. A number ``c`` labels
  rows by the threshold reward ≥ c instead (an option).
- ``agg = "group_mean"`` [INFERRED] the spec's per-group loss, each question group once.

**Notes**

1. Does not read advantages: the advantage estimator (``grpo``, ``sign``, …) does not change the
   loss (tests/test_dgpo.py); it composes with ratio terms (``ppo_clip``, ``gspo``) that do.
2. A question group with no coherent or no inconsistent member contributes exactly 0 (value and
   gradient), so does a row without loss tokens, with a NaN reward or in an invalid slot. One
   coherent row has variance 0. Garbage at masked positions never reaches ``s`` (zeroed first).
3. Question groups: the row extra ``direction`` (rollout ``directions``) splits a pooled group into
   its directions unless ``pool_directions``; without it a group is one question group. Each row
   returns v_i = L_q(i) · n_b / (K_b · n_q(i)) (n_b rows of its group with a loss token, K_b question
   groups with a member, n_q members of its question group), so ``group_mean`` gives the mean over
   a group's question groups, then over groups: micro-batch invariant (groups are never split).
4. Statistics: ``dgpo/score`` (s per row), ``dgpo/term_frac`` (share of rows in a question group
   with a term), ``dgpo/pair_acc`` (share of a term's pairs with s_p − s_n > gamma, per row).
5. Token weights: none (``token_weights = "none"``; objective.py): the margins compare whole
   sequences' scores and no source weighs their tokens, so a token weight is refused at build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from groupwise.losses._common import group_members, loss_tokens, required
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo

SCORES = ("logp", "ref")
DIRECTION = "direction"


def dgpo_loss(
    logp: Tensor,
    mask: Tensor,
    labels: Tensor,
    group_ids: Tensor,
    beta: float = 1.0,
    gamma: float = 0.2,
    lam_var: float = 1.0,
    ref_logp: Tensor | None = None,
) -> Tensor:
    """The spec's interface: mean over the question groups ``group_ids`` [N] of L_q, from ``logp`` [N,T],
    ``mask`` [N,T], ``labels`` [N] (True = coherent) and optionally ``ref_logp`` [N,T] (score "ref")."""
    ids = torch.unique(group_ids, return_inverse=True)[1]  # [N] 0..Q-1
    members = mask.bool().any(-1)  # [N]
    same = (ids[None, :] == ids[:, None]) & members[None, :] & members[:, None]  # [N,N]
    lp = masked_input(logp, mask.bool())  # [N,T]
    if ref_logp is not None:
        lp = lp - masked_input(ref_logp, mask.bool())  # [N,T]
    s = beta * lp.sum(-1) / mask.sum(-1).clamp(min=1).to(lp.dtype)  # [N]
    pos = members & labels.bool()  # [N]
    loss, _, _ = question_losses(s[None], pos[None], (members & ~pos)[None], same[None], gamma, lam_var)  # [1,N]
    share = torch.where(members, 1.0 / same.sum(-1).clamp(min=1).to(s.dtype), 0.0)  # [N] 1/n_q: each group once
    return (loss[0] * share).sum() / share.sum().clamp(min=1)  # []


def question_losses(
    s: Tensor, pos: Tensor, neg: Tensor, same: Tensor, gamma: float, lam_var: float
) -> tuple[Tensor, Tensor, Tensor]:
    """([b,G] L_q of each row's question group, 0 without a term; [b,G] the share of its pairs with
    s_p − s_n > gamma; [b,G] bool the group has a term) from scores ``s`` [b,G],
    coherent / inconsistent members and ``same`` [b,G,G]
    (rows i, j in one question group)."""
    pair = pos[:, :, None] & neg[:, None, :] & same  # [b,G,G] [b,p,n]
    gap = s[:, :, None] - s[:, None, :] - gamma  # [b,G,G] s_p − s_n − γ
    zero = torch.zeros((), dtype=s.dtype)
    hinge = torch.where(pair, F.softplus(-gap), zero)  # [b,G,G]
    won = torch.where(pair, (gap > 0).to(s.dtype), zero)  # [b,G,G]
    within = same.to(s.dtype)  # [b,G,G]
    n_pairs = (within @ pair.sum(-1, keepdim=True).to(s.dtype))[..., 0]  # [b,G] pairs of the row's question group
    margin = (within @ hinge.sum(-1, keepdim=True))[..., 0] / n_pairs.clamp(min=1)  # [b,G]
    acc = (within @ won.sum(-1, keepdim=True))[..., 0] / n_pairs.clamp(min=1)  # [b,G]
    sp = torch.where(pos, s, zero)  # [b,G]
    n_pos = (within @ pos.to(s.dtype)[..., None])[..., 0].clamp(min=1)  # [b,G]
    mean_pos = (within @ sp[..., None])[..., 0] / n_pos  # [b,G] mean coherent score of the row's group
    dev = torch.where(pos[:, None, :] & same, s[:, None, :] - mean_pos[:, :, None], zero)  # [b,G,G] [b,i,k]
    var = (dev * dev).sum(-1) / n_pos  # [b,G] population variance of the coherent scores
    has = n_pairs > 0  # [b,G]
    return torch.where(has, margin + lam_var * var, zero), torch.where(has, acc, zero), has


@register("objective", "dgpo")
@dataclass
class DGPO:
    """Margin loss of every coherent row over every inconsistent one + variance of the coherent scores (DGPO)."""

    beta: float = 1.0
    gamma: float = 0.2
    lam_var: float = 1.0
    score: str = "logp"
    pool_directions: bool = False
    positive_at: float | None = None
    coef: float = 1.0
    agg: str | None = "group_mean"

    token_weights = "none"  # Note 5
    token_weights_reason = "a margin loss between whole sequences' scores, with no token-weighted form"

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"dgpo: beta must be > 0 (the score's scale, spec default 1), got {self.beta}")
        if not self.gamma >= 0 or not self.lam_var >= 0:
            raise ValueError(
                "dgpo: gamma and lam_var must be >= 0 (spec defaults 0.2 "
                f"and 1), got gamma={self.gamma}, lam_var={self.lam_var}"
            )
        if self.score not in SCORES:
            raise ValueError(f"dgpo: score must be one of {', '.join(SCORES)}, got {self.score!r}")

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need("logp", model="ref"),) if self.score == "ref" else ()

    @property
    def rollout_extras(self) -> tuple[str, ...]:
        return (DIRECTION,) if self.pool_directions else ()  # build check: pooling needs rollout "directions"

    def _parts(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, ...]:
        mask = loss_tokens(mb)  # [b,G,T]
        lp = masked_input(out["logp"], mask)  # [b,G,T]
        if self.score == "ref":
            lp = lp - masked_input(required(mb, "logp_ref", "dgpo"), mask)  # [b,G,T]
        s = self.beta * lp.sum(-1) / mask.sum(-1).clamp(min=1).to(lp.dtype)  # [b,G]
        rewards = required(mb, "rewards", "dgpo").float()  # [b,G]
        members = group_members(mask, rewards)  # [b,G]
        direction = mb.extras.get(DIRECTION)
        if direction is None or self.pool_directions:
            same = torch.ones(s.shape + s.shape[-1:], dtype=torch.bool)  # [b,G,G]
        else:
            same = direction[:, :, None] == direction[:, None, :]  # [b,G,G]
        same = same & members[:, :, None] & members[:, None, :]  # [b,G,G]
        if self.positive_at is None:  # above the question group's mean; exactly none in a constant group
            r = torch.where(members, rewards, 0.0).double()  # [b,G]
            pos = members & (torch.where(same, r[:, :, None] - r[:, None, :], 0.0).sum(-1) > 0)  # [b,G]
        else:
            pos = members & (rewards >= self.positive_at)  # [b,G]
        loss, acc, has = question_losses(s, pos, members & ~pos, same, self.gamma, self.lam_var)  # [b,G] x3
        return s, loss, acc, has, same, members, mask

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        _, loss, _, _, same, members, mask = self._parts(mb, out)
        n_q = same.sum(-1).to(loss.dtype)  # [b,G] members of the row's question group (0 off the members)
        # [b,1] question groups with a member
        k = torch.where(members, 1.0 / n_q.clamp(min=1), 0.0).sum(1, keepdim=True)
        n_rows = mask.any(-1).sum(1, keepdim=True).to(loss.dtype)  # [b,1]
        return torch.where(members, loss * n_rows / (k.clamp(min=1) * n_q.clamp(min=1)), 0.0)  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        s, _, acc, has, _, _, _ = self._parts(mb, {"logp": out["logp"].detach()})
        return {"dgpo/score": s, "dgpo/term_frac": has.float(), "dgpo/pair_acc": acc}
