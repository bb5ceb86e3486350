"""Hard-Pair-GRPO: fit each pair's bounded local target on its 2-simplex by a KL (LPO on pairs).

"A Unified Pair-GRPO Family: From Implicit to Explicit Preference Constraints for Stable and General
RL Alignment", Hao Yu, 2026. https://arxiv.org/abs/2605.06375 (spec: specs/56; abstract only, no
code, full paper not read). The Soft variant is the advantage estimator ``pair_grpo``.

**Change vs GRPO**

- No clipped surrogate: the rows are paired as in ``pair_grpo`` and, per pair (w, l), the policy
  renormalised over the pair is fitted to a local target that raises the winner's relative mass by
  a bounded factor (the abstract's "explicit local probability constraints and constrained
  KL-fitting"); GRPO's KL to the reference stays a separate ``kl`` term (the spec's β).
- This is LPO (specs/57) on 2-row simplices with a bounded target: the projection is
  ``losses/lpo.py``'s ``simplex_divergence``.

**Math** (per pair (i, j) of valid rows with a loss token; ``s`` = ``rewards``, the configured total)::

    lam_i  = Σ_t mask·(logp − logp_old)                 base_i = Σ_t mask·logp_old = log π_old(y_i)
    pref   = 1[s_i > s_j] + ½·1[s_i = s_j]               (1: i is the winner w)
    c      = (1 + eps_p·(2·pref − 1), 1 − eps_p·(2·pref − 1))
    q      = softmax(base + log c)                       q_w ∝ π_old(w)·(1 + eps_p), q_l ∝ π_old(l)·(1 − eps_p)
    pbar   = softmax(base + lam)                         π_θ renormalised over the pair
    L_pair = KL(q ‖ pbar),   ∂L_pair/∂lam = pbar − q
    loss   = mean over the group's pairs of L_pair, every row of the group carrying it   # [b,G]

π_old(w) = π_old(l), eps_p = 0.2, θ = θ_old: q = [.6, .4], pbar = [.5, .5],
L = .6·ln 1.2 + .4·ln .8 = 0.020136, ∂L/∂(log π_w, log π_l) = [−0.1, 0.1].

**Defaults**

- Local probability constraints and constrained KL fitting [ABSTRACT]; the target and the loss
  above are the spec's [INFERRED] reading (flag ``hard_pair_inferred``).
- ``eps_p = 0.2`` [INFERRED] the spec's example; must be in [0, 1).
- ``pairing = "random"`` [INFERRED] the disjoint pairs of ``pair_grpo`` (same rows, same seed);
  ``"all"`` compares every pair of rows of the group.
- ``clip_eps = None`` [INFERRED] the spec's optional ratio bound π_θ(w)/π_old(w) ≤ 1 + clip_eps: a
  pair whose winner's sequence ratio exceeds it contributes no gradient (as PPO's clip).
- ``agg = "group_mean"`` [INFERRED] a per-prompt mean, as LPO. The reference KL (β) is the ``kl``
  term of the recipe [INFERRED] (the spec's β·KL(π_θ ‖ π_ref)).

**Notes**

1. Group-level term (``couples = "group"``, declared with LPO's in ``lpo.SimplexTerm``): returns [b,G],
   every row carrying its group's mean pair
   loss. A group without a pair (fewer than two valid rows) gives 0.
2. A tied pair has c = (1, 1): its target is π_old on the pair, so at θ_old its loss and gradient are
   exactly 0 (``base + 0`` on both sides, bit for bit); later it pulls the pair back to π_old's ratio.
3. ``on_policy_reinforce = False``: on-policy the gradient of a pair is (pbar − q)·∇lam, the
   projection's, not −adv·∇logp (the estimator's advantages are not read).
4. Rows with a NaN reward or without a loss token are in no pair (pairs are formed over the valid
   rows exactly as ``pair_grpo`` forms them; a pair with a member without loss tokens is dropped).
   Padding never reaches lam or base (inputs zeroed first).
5. ``lam`` is a sum over tokens: each token of row i gets ∂L/∂lam_i, bounded by |pbar − q| ≤ 1.
6. Statistics per row: ``divergence`` (its group's mean L_pair), ``pair_clip`` (share of the
   group's pairs whose gradient the ratio bound stopped).
7. ``hard_pair_loss`` is the spec's interface on sequence log-probs, with β·k3 of the sequence
   log-ratio to the reference when ``ref_seq_logp`` is given.
8. Token weights: none (``token_weights = "none"``, from ``lpo.SimplexTerm``; objective.py): a
   token weight is refused at build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.advantages.pair_grpo import PAIRINGS, pair_preference, rollout_pairs
from groupwise.errors import ConfigError
from groupwise.kl_estimators import K3
from groupwise.losses.lpo import SimplexTerm, sequence_log_ratio, simplex_divergence
from groupwise.masked import masked_mean
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def pair_divergence(
    lam: Tensor, base: Tensor, pairs: Tensor, pref: Tensor, eps_p: float, clip_eps: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(KL(q ‖ pbar) per pair [B,P] with its gradient in ``lam`` [B,G], pair exists [B,P], gradient stopped [B,P])."""
    B, P, _ = pairs.shape
    has = pairs[..., 0] >= 0  # [B,P]
    idx = pairs.clamp(min=0).flatten(1)  # [B,2P]
    lam2, base2 = lam.gather(1, idx).view(B, P, 2), base.gather(1, idx).view(B, P, 2)  # [B,P,2] x2
    tilt = eps_p * (2 * pref.float() - 1)  # [B,P] signed bonus of the first row
    target = torch.stack([torch.log1p(tilt), torch.log1p(-tilt)], dim=-1)  # [B,P,2] log c
    members = has[..., None].expand(B, P, 2).reshape(B * P, 2)  # [B·P,2]
    value, _, _ = simplex_divergence(
        lam2.reshape(B * P, 2), target.reshape(B * P, 2), members, "fkl", 1.0, base2.reshape(B * P, 2)
    )
    value = torch.where(has, value.view(B, P), torch.zeros(()))  # [B,P]
    stopped = torch.zeros_like(has)  # [B,P]
    if clip_eps is not None:
        win = torch.where(pref >= 0.5, lam2[..., 0], lam2[..., 1]).detach()  # [B,P] winner's log-ratio
        stopped = has & (pref != 0.5) & (win > math.log1p(clip_eps))  # [B,P]
        value = torch.where(stopped, value.detach(), value)  # [B,P]
    return value, has, stopped


def hard_pair_loss(
    seq_logp: Tensor,
    old_seq_logp: Tensor,
    pairs: Tensor,
    eps_p: float = 0.2,
    beta: float = 0.0,
    ref_seq_logp: Tensor | None = None,
    pref: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The spec's interface: (loss [], metrics) from sequence log-probs [B,G] and ``pairs`` [B,P,2]
    (winner first unless ``pref`` [B,P] says otherwise). loss = mean over groups with a pair of their
    mean KL(q ‖ pbar), plus β·mean over paired rows of k3(seq_logp, ref_seq_logp)."""
    pref = torch.ones(pairs.shape[:2], dtype=torch.float64) if pref is None else pref  # [B,P]
    value, has, _ = pair_divergence(seq_logp - old_seq_logp, old_seq_logp, pairs, pref, eps_p)  # [B,P] x2
    group = masked_mean(value, has, dim=1)  # [B]
    loss = masked_mean(group, has.any(1))  # []
    if beta and ref_seq_logp is not None:
        paired = torch.zeros(seq_logp.shape, dtype=torch.bool).scatter_(
            1, pairs.clamp(min=0).flatten(1), has.repeat_interleave(2, 1)
        )  # [B,G]
        loss = loss + beta * masked_mean(K3()(seq_logp, ref_seq_logp), paired)  # []
    return loss, {"pair_loss": value, "group_loss": group}


@register("objective", "hard_pair")
@dataclass
class HardPair(SimplexTerm):
    """KL from each pair's bounded local target to the policy renormalised on the pair (Hard-Pair-GRPO, Yu 2026)."""

    eps_p: float = 0.2
    pairing: str = "random"  # "random" | "all"
    clip_eps: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_p < 1.0:
            raise ConfigError(
                f"hard_pair: eps_p must be in [0, 1) (the loser's target factor is 1 − eps_p), got {self.eps_p}"
            )
        if self.pairing not in PAIRINGS:
            raise ConfigError(f"hard_pair: pairing must be one of {PAIRINGS}, got {self.pairing!r}")
        if self.clip_eps is not None and not self.clip_eps > 0:
            raise ConfigError(f"hard_pair: clip_eps must be > 0 or None (no ratio bound), got {self.clip_eps}")

    def _parts(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> tuple[Tensor, Tensor]:
        lam, base, mask = sequence_log_ratio(mb, out, "hard_pair")  # [b,G] x2, [b,G,T]
        if mb.rewards is None:
            raise ValueError(
                "objective term 'hard_pair' needs rollout.rewards (the pair preferences); run the reward stage first"
            )
        valid = mb.group_valid.bool() & torch.isfinite(mb.rewards)  # [b,G] as pair_grpo's valid_rows
        pairs = rollout_pairs(mb, info, valid, self.pairing)  # [b,P,2]
        tokens = mask.any(-1)  # [b,G]
        both = tokens.gather(1, pairs.clamp(min=0).flatten(1)).view(pairs.shape).all(-1)  # [b,P]
        pairs = torch.where(both[..., None], pairs, torch.full((), -1, dtype=pairs.dtype))  # [b,P,2]
        value, has, stopped = pair_divergence(
            lam, base, pairs, pair_preference(mb.rewards, pairs), self.eps_p, self.clip_eps
        )  # [b,P] x3
        group = masked_mean(value, has, dim=1)[:, None].expand(lam.shape)  # [b,G]
        clipped = masked_mean(stopped.float(), has, dim=1)[:, None].expand(lam.shape)  # [b,G]
        return group, clipped

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        self._info = info  # the pairs depend on the step: stats (called on the same micro-batch) pairs alike
        return self._parts(mb, out, info)[0]  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        group, clipped = self._parts(mb, {"logp": out["logp"].detach()}, self._info)  # [b,G] x2
        return {"divergence": group, "pair_clip": clipped}  # [b,G] x2
