"""Sequence-level truncated importance weight of rows another actor sampled (Mutual RL's PRP).

Mutual RL (Liu et al., arXiv 2605.07244; author blog https://xz-liu.github.io/blog/mutual-rl.html),
the peer-rollout-pooling probe. Spec: ``shared/specs/52-mutual-rl.md``.

**Change vs GRPO**: rows flagged ``injected`` were written by a peer (another model, another
tokenizer) and retokenised into the receiver's vocabulary (``rollout/mutual.py``). Both models'
probabilities are of the same string, so a sequence-level ratio corrects for the behaviour policy;
the receiver's own rows keep weight 1.

**Math** (``mask`` = the completion tokens of valid rows)::

    log π_recv(y) = Σ_t logp_old · mask           (the receiver's no-grad log-prob, Need("logp"))
    w = min(C, exp(log π_recv(y) − behav_seq_logp))   on injected rows           [B,G,1]
    w = 1                                              elsewhere
    weight = w · mask                                                                [B,G,T]

**Defaults** [INFERRED] (spec 52): sequence level, ``C = 2`` (the spec allows 1 or 2); the spec's
numbers: own −3, peer −5 → ``w = min(2, e²) = 2``. The exponent is clamped to ±20 (as
``sampler_is``).

**Notes**

1. ``step_stats()["mutual/prp_is_var"]``: the population variance of ``w`` over the injected rows
   (0 when there are none: SGT's rescue rows are not weighted unless this weight is configured).
2. ``log π_receiver`` is ``logp_old``, the receiver's log-prob before the update; the objective's
   ratio to ``logp_old`` is then the PPO ratio of the receiver's own moving policy, not to the peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import INJECTED, Need, Rollout, StepInfo


def peer_weights(own_seq_logp: Tensor, peer_seq_logp: Tensor, C: float) -> Tensor:
    """[...] ``min(C, exp(own − peer))`` (the exponent clamped to ±20)."""
    return torch.exp((own_seq_logp - peer_seq_logp).clamp(-20.0, 20.0)).clamp(max=C)


@register("weight", "peer_is")
@dataclass
class PeerIS:
    """min(C, π_receiver(y)/π_peer(y)) on rows a peer sampled, 1 on the receiver's own (Mutual RL's PRP)."""

    C: float = 2.0  # the truncation [INFERRED]

    needs = (Need("logp"),)
    rollout_extras = ("behav_seq_logp",)

    def __post_init__(self) -> None:
        if not self.C > 0:
            raise ValueError(f"peer_is: C must be > 0, got {self.C}")
        self._stats: dict[str, float] = {}

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if rollout.logp_old is None or "behav_seq_logp" not in rollout.extras:
            raise ValueError("peer_is needs rollout.logp_old (Need('logp')) and the row extra behav_seq_logp")
        mask = rollout.row_mask  # [B,G,T]
        own = (rollout.logp_old.float() * mask).sum(-1)  # [B,G]
        injected = rollout.flag(INJECTED) & rollout.group_valid  # [B,G]
        w = torch.where(injected, peer_weights(own, rollout.extras["behav_seq_logp"].float(), self.C), 1.0)  # [B,G]
        picked = w[injected].double()  # [n]
        self._stats = {"mutual/prp_is_var": float(picked.var(unbiased=False)) if picked.numel() else 0.0}
        return w[..., None] * mask  # [B,G,T]

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
