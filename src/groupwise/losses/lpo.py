"""LPO: a listwise target on the group's responses (softmax of advantages), reached by an exact divergence.

"Listwise Policy Optimization: Group-based RLVR as Target-Projection on the LLM Response Simplex",
Yun Qu, Qi Wang, …, Xiangyang Ji (Tsinghua, Tencent), 2026. https://arxiv.org/abs/2605.06139 —
no official code; only the abstract and a secondary summary were read. Spec: specs/57.

**Change vs GRPO**

- The G sampled responses of a prompt form a simplex. The policy restricted to it is
  p_theta = softmax of the responses' sequence log-ratios; the target is p_star = softmax(A / tau).
- The loss is the divergence between the two per prompt (forward or reverse KL), minimised
  exactly instead of GRPO's first-order ratio step: bounded gradients summing to zero over the
  group, no PPO clip, several epochs on one batch allowed.

**Math** (per group over its ``members``: rows with a loss token and a finite reward)::

    lam      = Σ_t mask·(logp − logp_old)         (length_norm: / Σ_t mask)     # [b,G]
    A        = Σ_t mask·adv_t / Σ_t mask                                          # [b,G]
    log_p    = log_softmax_members(lam)            log_star = log_softmax_members(A / tau)
    fkl:  L  = Σ_i p_star_i·(log_star_i − log_p_i)     ∂L/∂lam_i = p_i − p_star_i
    rkl:  L  = Σ_i p_i·(log_p_i − log_star_i)          ∂L/∂lam_i = p_i·((log_p_i − log_star_i) − L)
    loss     = L broadcast to the group's rows        # [b,G]; agg "group_mean" = mean over prompts

At theta = theta_old every lam = 0 and p is uniform: the forward gradient is 1/n − p_star_i ≈
−(A_i − mean A)/(n·tau) for small A/tau — GRPO's direction (n = the group's members).

**Defaults**

- ``tau = 1.0`` [INFERRED] the spec's default temperature (the abstract: "temperature-controlled").
- ``divergence = "fkl"`` [INFERRED]; ``"rkl"`` is the paper's other choice [ABSTRACT].
- ``length_norm = False`` [INFERRED] the sequence log-ratio is the log-likelihood ratio of the
  whole response; ``True`` uses GSPO's length-normalised one (an option).
- ``agg = "group_mean"`` [INFERRED] the spec's per-prompt mean.
- The target's A is the configured estimator's advantage ("matched target", GRPO's by default)
  [INFERRED].

**Notes**

1. Group-level term: returns [b,G], every row carrying its group's L (``couples = "group"``:
   micro-batches hold whole groups). Under another aggregation a group weighs by its rows/tokens.
2. A group with one member has p = p_star = 1 and L = 0; with none, 0. At theta_old a group of
   all-equal advantages (a constant-reward group) has p = p_star = uniform: L = 0 and gradient 0.
   In later epochs (p ≠ uniform) such a group pulls p back to uniform: the projection keeps the
   relative likelihoods of responses it has no preference between (no zero-advantage skip).
3. ``on_policy_reinforce = False``: on-policy the gradient is (1/n − p_star_i)·∇lam_i, the
   projection's, not −A·∇logp (the two agree to first order in A/tau, up to the factor 1/(n·tau)).
4. Rows without a loss token or with a NaN reward (no verdict) are outside the simplex; padding and
   garbage outside the mask never reach lam (inputs zeroed first). Token advantages are reduced to
   their row mean.
5. ``lam`` is a sum over tokens, so its gradient per token is bounded by |p_i − p_star_i| ≤ 1
   whatever the length; with ``length_norm`` it is divided by the length.
6. Statistics per row: ``tv`` = ½·Σ_i |p_i − p_star_i| of its group (0 at the target), and
   ``divergence`` = L.
7. Exactness: L is evaluated without gradient and its gradient in lam is given in closed form
   (value + Σ_i g_i·(lam_i − sg[lam_i]), g the formulas above, checked against autograd of the plain
   KL in tests/test_lpo.py). Autograd through log_softmax leaves −p*_i + p_i·Σ_j p*_j, which is not
   0 when Σ_j p*_j rounds off 1; with the advantages centred by their group maximum, a group of equal
   advantages at theta_old gives p = p_star bit for bit, so L and its gradient are exactly 0.
8. ``simplex_divergence`` (the projection on a group's simplex, with an optional common ``base``
   logit) and ``sequence_log_ratio`` (lam of a micro-batch) are shared with ``hard_pair``
   (Hard-Pair-GRPO, specs/56), whose simplices are the 2-row pairs.
9. Token weights: none (``token_weights = "none"``, declared in ``SimplexTerm`` for ``hard_pair``
   too; objective.py): the projection compares whole sequences and no source weighs their tokens,
   so a token weight is refused at build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import group_members, loss_tokens, required, row_advantages
from groupwise.losses.gspo import seq_log_ratio
from groupwise.masked import group_log_softmax, masked_input, masked_sum
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

DIVERGENCES = ("fkl", "rkl")


def lpo_target(adv: Tensor, tau: float = 1.0, valid: Tensor | None = None) -> Tensor:
    """[B,G] the listwise target p_star = softmax over the group's valid rows of adv / tau (0 elsewhere)."""
    valid = torch.ones_like(adv, dtype=torch.bool) if valid is None else valid
    return torch.where(valid, group_log_softmax(adv / tau, valid).exp(), torch.zeros(()))  # [B,G]


def simplex_divergence(
    lam: Tensor, target: Tensor, valid: Tensor, divergence: str = "fkl", tau: float = 1.0, base: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The projection on each group's simplex (shared with ``hard_pair``): p = softmax_valid(base + lam),
    p_star = softmax_valid(base + target / tau) ([B,G] logits; ``base`` 0 by default). Returns (the
    divergence per group [B], with its closed-form gradient in ``lam`` (Note 7), p [B,G], p_star [B,G])."""
    top = torch.where(valid, target, torch.full((), -torch.inf)).amax(1, keepdim=True)  # [B,1]
    centred = torch.where(valid, target - top, torch.zeros(())) / tau  # [B,G] equal targets → exactly 0 (Note 7)
    shift = torch.zeros(()) if base is None else torch.where(valid, base, torch.zeros(()))  # [B,G] or []
    log_p, log_star = (
        group_log_softmax(shift + lam.detach(), valid),
        group_log_softmax(shift + centred, valid),
    )  # [B,G] x2
    p, p_star = torch.where(valid, log_p.exp(), 0.0), torch.where(valid, log_star.exp(), 0.0)  # [B,G] x2
    if divergence == "fkl":
        value = masked_sum(p_star * (log_star - log_p), valid, dim=1)  # [B]
        grad = p - p_star  # [B,G] ∂L/∂lam
    elif divergence == "rkl":
        value = masked_sum(p * (log_p - log_star), valid, dim=1)  # [B]
        grad = torch.where(valid, p * (log_p - log_star - value[:, None]), 0.0)  # [B,G] ∂L/∂lam
    else:
        raise ValueError(f"lpo: divergence must be one of {', '.join(DIVERGENCES)}, got {divergence!r}")
    return (
        value + (grad * (lam - lam.detach())).sum(1),
        p,
        p_star,
    )  # [B] the value, with the closed-form gradient in lam


def lpo_loss(
    seq_logp: Tensor,
    old_seq_logp: Tensor,
    adv: Tensor,
    tau: float = 1.0,
    divergence: str = "fkl",
    valid: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(per-prompt mean of the divergence [], metrics) from sequence log-probs [B,G] (spec interface).
    metrics: ``group_loss`` [B] (differentiable in ``seq_logp``), ``p`` and ``p_star`` [B,G] on the valid rows."""
    valid = torch.ones_like(adv, dtype=torch.bool) if valid is None else valid
    lam = torch.where(valid, seq_logp - old_seq_logp, torch.zeros(()))  # [B,G]
    group, p, p_star = simplex_divergence(lam, adv, valid, divergence, tau)  # [B], [B,G] x2
    has = valid.any(1)  # [B]
    loss = masked_sum(group, has) / has.sum().clamp(min=1)  # []
    return loss, {"group_loss": group, "p": p, "p_star": p_star}


def sequence_log_ratio(
    mb: Rollout, out: dict[str, Tensor], who: str, length_norm: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """(lam [b,G] = Σ_t mask·(logp − logp_old) (mean_t with ``length_norm``), Σ_t mask·logp_old [b,G],
    mask [b,G,T] = the loss tokens): the sequence quantities of the simplex terms (lpo, hard_pair)."""
    mask = loss_tokens(mb)  # [b,G,T]
    logp = masked_input(out["logp"], mask)  # [b,G,T]
    logp_old = masked_input(required(mb, "logp_old", who), mask)  # [b,G,T]
    lam = seq_log_ratio(logp, logp_old, mask) if length_norm else masked_sum(logp - logp_old, mask, dim=-1)  # [b,G]
    return lam, logp_old.sum(-1), mask


@dataclass
class SimplexTerm:
    """What the group-simplex terms (``lpo``, ``hard_pair``) share: a group's loss on each of its rows,
    a per-prompt mean, whole groups per micro-batch, and the projection's own on-policy gradient."""

    coef: float = 1.0
    agg: str | None = "group_mean"

    needs = ()
    couples = "group"
    on_policy_reinforce = False  # Note 3: the projection's gradient, not REINFORCE
    token_weights = "none"  # Note 9
    token_weights_reason = "a divergence on the group's simplex of whole-sequence log-ratios, with no weighted form"


@register("objective", "lpo")
@dataclass
class LPO(SimplexTerm):
    """Divergence between the policy on the group's responses and the softmax-of-advantages target (LPO, Qu et al.
    2026)."""

    tau: float = 1.0
    divergence: str = "fkl"
    length_norm: bool = False

    def __post_init__(self) -> None:
        if not self.tau > 0:
            raise ValueError(f"lpo: tau must be > 0 (the target's temperature), got {self.tau}")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"lpo: divergence must be one of {', '.join(DIVERGENCES)}, got {self.divergence!r}")

    def _parts(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        lam, _, mask = sequence_log_ratio(mb, out, "lpo", self.length_norm)  # [b,G], _, [b,G,T]
        adv = row_advantages(mb, mask, "lpo")  # [b,G]
        _, parts = lpo_loss(lam, torch.zeros_like(lam), adv, self.tau, self.divergence, group_members(mask, mb.rewards))
        return parts["group_loss"][:, None].expand(lam.shape), parts  # [b,G]

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        return self._parts(mb, out)[0]  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        loss, parts = self._parts(mb, {"logp": out["logp"].detach()})  # [b,G]
        tv = 0.5 * (parts["p"] - parts["p_star"]).abs().sum(1, keepdim=True)  # [b,1]
        return {"tv": tv.expand(loss.shape), "divergence": loss}  # [b,G] x2
