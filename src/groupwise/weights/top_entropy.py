"""Train only on the high-entropy "forking" tokens: keep the top-ρ tokens by entropy.

"Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning for
LLM Reasoning", Shenzhi Wang, Le Yu, Chang Gao et al., 2025. https://arxiv.org/abs/2506.01939

**Change vs GRPO**: the policy-gradient loss is restricted to the ρ fraction of completion tokens
with the highest entropy in the batch; the other tokens get weight 0. As in the paper and TRL
(``top_entropy_quantile``), they still count in the normalisers and the KL term still covers them
(``scope = "loss"``); ``scope = "token"`` removes them from every term and normaliser instead, which
makes the gradient about 1/ρ larger (5x at ρ = 0.2) under a token- or sequence-mean aggregation.

**Math** (``H`` = entropy of the policy's next-token distribution at each completion token)::

    n     = Σ mask                     (loss tokens of the whole step batch)
    k     = ceil(rho * n)
    tau   = k-th largest H among masked tokens
    w     = mask · [H >= tau]

**Defaults**

- ``rho = 0.2`` [PAPER] the top 20 % of tokens.
- ``scope = "loss"`` [PAPER] [CODE] TRL ``GRPOTrainer`` multiplies the per-token policy loss by the
  entropy mask and keeps ``completion_mask`` as the normaliser, then adds the KL on every token;
  ``"token"`` [INFERRED] is groupwise's earlier behaviour, kept as an option.

**Notes**

1. The threshold is batch-level, over every masked token of the step batch (the paper computes
   the entropy percentile per batch); the weight stage runs once per step before micro-batching.
2. Ties [INFERRED]: every token with H equal to the threshold is kept, so when entropies tie at
   the threshold the kept fraction can exceed rho (never fall below it). ``k`` rounds up, so
   at least one token is kept whenever ``n > 0``.
3. Tokens with a non-finite entropy are never kept and do not count in ``n``.
4. Reads ``rollout.extras["entropy"]`` [B,G,T] (a no-grad ``Need("entropy")``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo


@register("weight", "top_entropy")
@dataclass
class TopEntropy:
    """Keep only the top-ρ highest-entropy tokens of the batch (80/20 forking tokens, Wang et al. 2025)."""

    rho: float = 0.2
    scope: str = "loss"  # "loss": masked tokens stay in the normalisers (paper, TRL) | "token": they leave everything

    needs = (Need("entropy"),)

    def __post_init__(self) -> None:
        if not 0.0 < self.rho <= 1.0:
            raise ValueError(f"top_entropy: rho must be in (0, 1], got {self.rho}")
        if self.scope not in ("loss", "token"):
            raise ValueError(f"top_entropy: scope must be 'loss' or 'token', got {self.scope!r}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if "entropy" not in rollout.extras:
            raise ValueError("top_entropy needs rollout.extras['entropy'] (declared Need('entropy'))")
        H = rollout.extras["entropy"].float()  # [B,G,T]
        ok = rollout.row_mask.bool() & torch.isfinite(H)  # [B,G,T]
        n = int(ok.sum())
        if n == 0:
            return torch.zeros(H.shape, dtype=torch.float32)  # [B,G,T]
        k = min(n, math.ceil(round(self.rho * n, 6)))  # round() guards 0.2*15 = 3.0000000000000004
        tau = torch.topk(H[ok], k).values[-1]  # [] k-th largest entropy
        return (ok & (H >= tau)).float()  # [B,G,T]
