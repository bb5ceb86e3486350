"""ConSPO: a group-wise InfoNCE loss on length-normalised sequence log-probs, with a curriculum margin.

"Revisiting Reinforcement Learning with Verifiable Rewards from a Contrastive Perspective"
(ConSPO, Contrastive Sequence-level Policy Optimization), Zhang, Ma, Dong, Leng, Zhao, Sun, Yang,
Jiang (BIT, Alibaba Qwen), 2026. https://arxiv.org/abs/2605.12969 — only the abstracts (v1, v3)
were available; code "upon acceptance". Spec: specs/25.

**Change vs GRPO**

- No importance ratio and no advantage: each verified-correct rollout is a positive contrasted
  against the incorrect rollouts of its own group (the distractors) by an InfoNCE loss on the
  sequences' mean token log-probabilities under the current policy.
- A margin m handicaps the positive; it grows on a curriculum (give ``margin`` as a schedule), from
  a coarse ordering of positives above negatives to a wider separation.

**Math** (``mask`` = loss tokens; positives P: reward >= threshold, negatives N: reward < threshold,
among the rows with a loss token and a finite reward)::

    s_i   = Σ_t mask·logp / Σ_t mask                                   # [b,G] (with gradient)
    l_p   = −log( e^{(s_p − m)/tau} / (e^{(s_p − m)/tau} + Σ_{n∈N} e^{s_n/tau}) )
          = softplus( logsumexp_{n∈N}(s_n/tau) − (s_p − m)/tau )       # [b,G] on P
    L_g   = mean_{p∈P} l_p   if P and N are both non-empty, else 0      # [b]
    loss  = L_g · scale broadcast to the group's rows                   # [b,G]
    scale = #groups / #groups with both (norm = "mixed"), 1 (norm = "all")

With ``agg = "group_mean"`` (the default) the batch loss is Σ_g L_g / #groups with both: the mean
over the groups that have a positive and a negative. Gradient: ∂l_p/∂s_p = −(1 − q_p)/tau,
∂l_p/∂s_n = q_n/tau, q = the softmax over {positive with margin, negatives} — largest for poorly
separated positives and high-scoring negatives.

**Defaults** (the loss form is the spec's reading of "group-wise InfoNCE-style" [INFERRED])

- score = mean token log-probability, length-normalised [ABSTRACT].
- ``tau = 0.1`` [INFERRED] the spec's default temperature.
- ``margin = 0.0`` [INFERRED] the curriculum's start; the spec's curriculum is linear from 0 to
  m_max = 0.05 nats/token over the first half of training [INFERRED] (the recipe:
  ``margin = {schedule = "linear", start_value = 0.0, end = 0.05, steps = <half the run>}``;
  ``cosine`` and ``step`` schedules are its options).
- ``threshold = 0.5`` [INFERRED] binary rewards: 1 positive, 0 negative.
- ``norm = "mixed"`` [INFERRED] the spec's "mean over groups with both"; ``"all"`` counts every
  group (uninformative ones as 0, GRPO's convention for zero-advantage groups).
- ``agg = "group_mean"`` [INFERRED] a mean over groups.

**Notes**

1. Group-level term (``couples = "group"``): every row of a group carries its group's loss.
2. Groups without a positive or without a negative give exactly 0 (constant-reward groups, a
   single valid row, an empty group). Rows without a loss token or with a NaN reward are in neither
   set; padding never reaches s (inputs zeroed first).
3. ``norm = "mixed"``: :meth:`prepare` counts the groups with both on the step's whole batch (all
   ranks) and stores ``scale`` as the group extra ``conspo.scale``, so the loss does not depend on
   the micro-batch split or world size. The count is the step's: with ``train.minibatches > 1`` each
   mini-batch (normalised by its own group count) is scaled by the step's ratio, not its own. Without
   ``prepare`` (a bare call) the rows given are the batch.
4. No ``logp_old``: scores are recomputed under the current policy in every epoch, so the term is
   off-policy-safe without a ratio; it does not reduce to REINFORCE (it reads no advantage). A KL
   term composes as usual.
5. Statistics: ``score`` (s_i per row).
6. Token weights: none (``token_weights = "none"``; objective.py). The InfoNCE contrasts whole
   sequences' scores and no source defines a token-weighted form, so a configuration with a token
   weight is a ``ConfigError`` at build rather than a weight the loss would silently ignore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from groupwise.losses._common import group_members, loss_tokens
from groupwise.masked import masked_input, masked_logsumexp, masked_mean
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

NORMS = ("mixed", "all")
SCALE_KEY = "conspo.scale"


def seq_scores(logp: Tensor, mask: Tensor) -> Tensor:
    """[b,G] length-normalised sequence log-probabilities s_i = mean over ``mask`` of logp (0 for an empty row)."""
    return masked_mean(logp, mask, dim=-1)  # [b,G]


def split_by_reward(mask: Tensor, rewards: Tensor, threshold: float = 0.5) -> tuple[Tensor, Tensor]:
    """(positives, negatives) [b,G] bool: members (a loss token, a finite reward) with reward >= / < threshold."""
    members = group_members(mask, rewards)  # [b,G]
    return members & (rewards >= threshold), members & (rewards < threshold)  # [b,G] x2


def conspo_group_loss(s: Tensor, pos: Tensor, neg: Tensor, tau: float, margin: float) -> tuple[Tensor, Tensor]:
    """(L_g [b] the mean InfoNCE loss of each group's positives, exactly 0 without both; l [b,G], 0 off P)."""
    lse_neg = masked_logsumexp(s / tau, neg, dim=1)  # [b,1] −inf without negatives
    mixed = pos.any(1) & neg.any(1)  # [b]
    on = pos & mixed[:, None]  # [b,G]
    l = torch.where(on, F.softplus(lse_neg - (s - margin) / tau), torch.zeros(()))  # [b,G]
    return masked_mean(l, on, dim=1), l  # [b], [b,G]


def conspo_loss(
    logp: Tensor, mask: Tensor, rewards: Tensor, tau: float = 0.1, margin: float = 0.0, threshold: float = 0.5
) -> tuple[Tensor, Tensor]:
    """(batch loss = mean over the groups with a positive and a negative, seq_scores [B,G]) from
    ``logp`` [B,G,T], ``mask`` [B,G,T] and binary ``rewards`` [B,G] (spec interface)."""
    s = seq_scores(masked_input(logp, mask), mask)  # [B,G]
    pos, neg = split_by_reward(mask, rewards, threshold)  # [B,G] x2
    group, _ = conspo_group_loss(s, pos, neg, tau, margin)  # [B]
    mixed = pos.any(1) & neg.any(1)  # [B]
    return group.sum() / mixed.sum().clamp(min=1), s


@register("objective", "conspo")
@dataclass
class ConSPO:
    """Group-wise InfoNCE of each correct rollout against the group's incorrect ones on mean token log-probs (ConSPO,
    Zhang et al. 2026)."""

    tau: float = 0.1
    margin: float = 0.0
    threshold: float = 0.5
    norm: str = "mixed"
    coef: float = 1.0
    agg: str | None = "group_mean"

    needs = ()
    couples = "group"
    token_weights = "none"  # Note 6
    token_weights_reason = "an InfoNCE contrast of whole sequences' mean log-probs, with no token-weighted form"

    def __post_init__(self) -> None:
        if not self.tau > 0:
            raise ValueError(f"conspo: tau must be > 0 (the InfoNCE temperature; the spec uses 0.1), got {self.tau}")
        if self.norm not in NORMS:
            raise ValueError(f"conspo: norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        if not (math.isfinite(self.margin) and math.isfinite(self.threshold)):
            raise ValueError(
                "conspo: margin and threshold must be finite numbers, "
                f"got margin={self.margin}, threshold={self.threshold}"
            )

    def _sets(self, mb: Rollout, mask: Tensor) -> tuple[Tensor, Tensor]:
        if mb.rewards is None:
            raise ValueError(
                "objective term 'conspo' needs rollout.rewards (positives are rows with reward >= threshold)"
            )
        return split_by_reward(mask, mb.rewards, self.threshold)  # [b,G] x2

    def _scale(self, mb: Rollout, mask: Tensor) -> Tensor:
        """[b] the batch's #groups / #groups with both (1 for norm = "all"), Note 3."""
        if self.norm == "all":
            return torch.ones(mask.shape[0])
        if SCALE_KEY in mb.extras:
            return mb.extras[SCALE_KEY]  # [b]
        pos, neg = self._sets(mb, mask)  # [b,G] x2
        groups, mixed = mask.any(-1).any(-1).sum(), (pos.any(1) & neg.any(1)).sum()
        return torch.full((mask.shape[0],), float(groups) / max(int(mixed), 1))  # [b]

    def prepare(self, batch: Rollout, info: StepInfo) -> None:
        """Once per step on the whole batch: the group-count ratio of norm = "mixed" (Note 3)."""
        batch.extras.pop(SCALE_KEY, None)
        batch.set_extra(SCALE_KEY, self._scale(batch, loss_tokens(batch)), "group")

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        mask = loss_tokens(mb)  # [b,G,T]
        s = seq_scores(masked_input(out["logp"], mask), mask)  # [b,G]
        group, _ = conspo_group_loss(s, *self._sets(mb, mask), self.tau, self.margin)  # [b]
        return (group * self._scale(mb, mask))[:, None].expand(s.shape)  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        mask = loss_tokens(mb)  # [b,G,T]
        return {"score": seq_scores(masked_input(out["logp"].detach(), mask), mask)}  # [b,G]
