"""GraphDPO: a Plackett–Luce-style DPO loss over the preference DAG of a group's scored rollouts.

"Beyond Pairs: Your Language Model is Secretly Optimizing a Preference Graph", Ning Liu, Chuanneng
Sun, Kristina Klinkner, Shervin Malmasi, 2026. https://arxiv.org/abs/2605.08037 — specs/46
(abstract only; no code).

**Change vs GRPO**

- No advantage-weighted surrogate: the G scored rollouts of a prompt form a DAG (i → j iff i
  scores higher), equal scores form a layer, and every node competes, in a softmax over DPO's
  implicit rewards, against all the nodes it dominates. Needs the reference model's log-probs.
- One preferred and one rejected rollout give exactly DPO's −log σ(β·Δ); tied rollouts are never
  pushed apart.

**Math** (``logp``, ``logp_ref`` summed over each row's completion tokens; per group)::

    h_i    = beta * Σ_t mask·(logp - logp_ref)                      implicit reward       [b,G]
    D(i)   = {j : score_j < score_i}                              (strictly lower layers)
    loss_i = -h_i + logsumexp({h_i} ∪ {h_j : j ∈ D(i)})           for every node with D(i) ≠ ∅
    L      = mean over groups of mean_{i : D(i) ≠ ∅} loss_i       (normalize = "terms")

**Defaults**

- ``beta = 0.1`` [INFERRED] DPO's convention (spec 46).
- ``scores = "rewards"`` [ABSTRACT] the ranking of the scored rollouts; ``"advantages"`` [INFERRED]
  ranks by ``rollout.advantages`` (a row mean if per token), so an advantage shaper can reorder the
  DAG. Within a group ``grpo`` and ``sign`` advantages are monotone in the reward: same DAG.
- ``normalize = "terms"`` [INFERRED] the mean over the nodes that have a term (spec 46's L);
  ``"rows"``: the mean over all rows (a node without a term counts as 0, as a zero-advantage row).
- ``agg = "seq_mean_token_mean"`` [INFERRED] one value per row, each row counted once (Note 3).

**Notes**

1. Nodes: rows with at least one loss token and a finite score. Invalid rows, NaN rewards and
   empty completions are not nodes: they get loss 0 and dominate nothing. A group with fewer than
   two layers (all tied, one node) has no term: loss 0 and exactly zero gradient.
2. Layers (:func:`preference_layers`, for statistics and tests): the rank of the node's distinct
   score, 0 = best. D(i) is the union of the layers below i's, i.e. the transitive closure of the
   ranking; the implementation compares scores pairwise, O(G²) per group (the spec's linear-time
   suffix log-sum-exp gives the same numbers; G is small).
3. The term returns one value per row, v_i = loss_i · n_b / n_terms_b (n_b = rows of the group with
   loss tokens, what the aggregation counts; ``normalize = "terms"``). Under
   ``seq_mean_token_mean`` the loss is Σ_b n_b·mean_terms(loss) / Σ_b n_b: the spec's mean over
   prompts of the per-prompt mean whenever groups have equal sizes, and micro-batch invariant
   (groups are never split; the aggregation's row count is whole-batch). Token-weighted
   aggregations (``token_mean``) weigh rows by their length instead.
4. The spec's optional verified-solution anchor (a top-layer node with an annealed weight) is not
   implemented: no rollout strategy injects ground-truth rows.
5. Statistics (per row, averaged over rows): ``graphdpo/h`` the implicit reward, ``graphdpo/term_frac``
   the share of rows with a term, ``graphdpo/acc`` the share of rows with a term whose h exceeds
   every h they dominate.
6. Token weights: none (``token_weights = "none"``; objective.py): the DAG compares whole sequences
   and no source weighs their tokens, so a token weight is refused at build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import loss_tokens, required, row_advantages, scored_rows, seq_ref_log_ratio
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo

SCORES = ("rewards", "advantages")
NORMALIZE = ("terms", "rows")


def dominance(scores: Tensor, node: Tensor) -> Tensor:
    """[B,G,G] bool: ``[b,i,j]`` = nodes i and j, and j scores strictly lower than i."""
    s = torch.where(node, scores.double(), torch.zeros((), dtype=torch.float64))  # [B,G]
    both = node[:, :, None] & node[:, None, :]  # [B,G,G]
    return both & (s[:, None, :] < s[:, :, None])  # [B,G,G]


def preference_layers(scores: Tensor, node: Tensor) -> Tensor:
    """[B,G] long: the rank of each node's distinct score (0 = best, ties share a layer); −1 off the nodes."""
    G = scores.shape[1]
    s = torch.where(node, scores.double(), torch.zeros((), dtype=torch.float64))  # [B,G]
    same = node[:, :, None] & node[:, None, :] & (s[:, :, None] == s[:, None, :])  # [B,G,G]
    earlier = torch.ones(G, G, dtype=torch.bool).tril(-1)  # [G,G] k < j
    first = node & ~(same & earlier).any(-1)  # [B,G] the first node of its score value
    better = dominance(scores, node).transpose(1, 2)  # [B,G,G] [b,i,j]: j scores higher than i
    layer = (better & first[:, None, :]).sum(-1)  # [B,G] distinct higher scores
    return torch.where(node, layer, torch.full((), -1))


def graphdpo_node_losses(h: Tensor, scores: Tensor, node: Tensor) -> tuple[Tensor, Tensor]:
    """([B,G] loss_i, 0 without a term; [B,G] bool has a term) from implicit rewards ``h`` [B,G]."""
    dom = dominance(scores, node)  # [B,G,G]
    eye = torch.eye(h.shape[1], dtype=torch.bool)  # [G,G] each node's own h is in its denominator
    z = torch.where(dom | eye, h[:, None, :], torch.full((), -torch.inf))  # [B,G,G]
    has = dom.any(-1)  # [B,G]
    loss = torch.logsumexp(z, -1) - h  # [B,G]
    return torch.where(has, loss, torch.zeros((), dtype=loss.dtype)), has


@register("objective", "graphdpo")
@dataclass
class GraphDPO:
    """Plackett–Luce-style DPO over the preference DAG of each group (GraphDPO, Liu et al. 2026)."""

    beta: float = 0.1
    scores: str = "rewards"
    normalize: str = "terms"
    coef: float = 1.0
    agg: str | None = "seq_mean_token_mean"

    needs = (Need("logp", model="ref"),)
    token_weights = "none"  # Note 6
    token_weights_reason = "a Plackett-Luce DPO loss over whole sequences' implicit rewards, with no weighted form"

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"graphdpo: beta must be > 0 (DPO's temperature, e.g. 0.1), got {self.beta}")
        for key, allowed in (("scores", SCORES), ("normalize", NORMALIZE)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"graphdpo: {key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")

    def _scores(self, mb: Rollout) -> Tensor:
        if self.scores == "advantages":
            return row_advantages(mb, loss_tokens(mb), "graphdpo")  # [b,G]
        rewards = required(mb, "rewards", "graphdpo").float()  # [b,G]
        if rewards.dim() != 2:
            raise ValueError(f"graphdpo: rewards must be [B,G], got {tuple(rewards.shape)}")
        return rewards

    def _parts(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, ...]:
        scores = self._scores(mb)  # [b,G]
        node = scored_rows(mb, scores)  # [b,G]
        h = self.beta * seq_ref_log_ratio(mb, out, "graphdpo")  # [b,G]
        loss, has = graphdpo_node_losses(h, scores, node)  # [b,G], [b,G]
        return h, loss, has, dominance(scores, node)

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        _, loss, has, _ = self._parts(mb, out)  # [b,G] ×2
        if self.normalize == "rows":
            return loss  # [b,G]
        n_rows = loss_tokens(mb).any(-1).sum(1, keepdim=True).to(loss.dtype)  # [b,1]
        n_terms = has.sum(1, keepdim=True).to(loss.dtype)  # [b,1]
        return loss * n_rows / n_terms.clamp(min=1)  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        h, _, has, dom = self._parts(mb, out)
        h = h.detach()  # [b,G]
        beaten = torch.where(dom, h[:, None, :], torch.full((), -torch.inf)).amax(-1)  # [b,G] best dominated h
        return {"graphdpo/h": h, "graphdpo/term_frac": has.float(), "graphdpo/acc": (has & (h > beaten)).float()}
