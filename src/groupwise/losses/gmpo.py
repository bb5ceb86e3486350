"""GMPO: maximise the geometric mean of the token-level rewards, clipped token-wise in log space.

"Geometric-Mean Policy Optimization", Yuzhong Zhao, Yue Liu, Junpeng Liu, Jingye Chen, Xun Wu,
Yaru Hao, Tengchao Lv, Shaohan Huang, Lei Cui, Qixiang Ye, Fang Wan, Furu Wei, 2025.
https://arxiv.org/abs/2507.20673 — authors' code: github.com/callsys/GMPO ``train_zero_math_gmpo.py``
(``ZeroMathLearner.learning_step``, ``critic_type_modify == "gmpo"``), merged into verl as
``verl/trainer/ppo/core_algos.py::compute_policy_loss_geo_mean`` (``loss_mode=geo_mean``), the form
matched here. TRL 1.16 has no GMPO loss type.

**Change vs GRPO**

- The objective of a sequence is the geometric mean of its token ratios times the advantage,
  not their arithmetic mean: one outlier token ratio moves it far less.
- Clipping is per token on the log-ratio, pessimistic by advantage sign, before the mean; the
  range is wider (e^±0.4 instead of 1 ± 0.2).

**Math** (``mask`` = loss tokens: completion tokens of valid rows not removed by a token weight;
``sgn = sign(adv)`` per token; ``w`` = the token weights, 1 without any)::

    d      = logp - logp_old                                                    # [b,G,T]
    d_clip = sgn * min(sgn * d, sgn * clip(d, -eps_low, eps_high))              # [b,G,T]
           = min(d, eps_high) if adv > 0,  max(d, -eps_low) if adv < 0,  0 if adv = 0
    ratio  = exp(Σ_t mask·d_clip / |y|)                                         # [b,G]
    adv_s  = Σ_t mask·adv / |y|                                                 # [b,G]
    loss   = -adv_s * ratio                                                     # [b,G]
    loss   = loss * exp(Σ_t mask·log w / |y|)     (token weights: the objective, "row:geo_mean")

This is the paper's (Π_t |min(ρ_t A, clip(ρ_t, e^−eps_low, e^eps_high) A)|)^{1/|o|}·sgn(A).

**Defaults**

- ``eps_low = eps_high = 0.4`` [CODE] callsys/GMPO ``scripts/qwen2.5-math-7b-gmpo.sh``
  (``CLIPRANGE=0.4``) and verl ``examples/gmpo_trainer`` (``clip_ratio=0.4``): ratio range
  (e^−0.4, e^0.4) ≈ (0.670, 1.492).
- Aggregation: use ``agg = "seq_mean_token_mean"`` (the project default; a row value is its own
  mean) to match verl (``torch.mean`` over sequences, ``loss_agg_mode`` ignored) and the authors'
  code (one sequence per micro-batch, averaged by gradient accumulation) [CODE].

**Notes**

1. Row-level term: returns [b,G]. Under ``token_mean`` a row counts once per token (length-
   weighted); that is not the paper's objective.
2. A log-ratio exactly on a bound keeps its full gradient (the two branches of the min tie and
   ``clamp`` passes gradient at its bounds); past the bound, adv > 0 tokens above ``eps_high``
   (adv < 0 tokens below −eps_low) contribute a constant and no gradient, the others stay free.
3. On-policy every d = 0: ratio = 1 and ∇loss = −adv·mean_t ∇logp_t, the REINFORCE gradient of a
   row-mean; under each built-in aggregation this equals the token REINFORCE gradient.
4. Token-level advantages are reduced to their row mean (verl: "we only support sequence level
   advantage"), their per-token signs still choose the clip side. verl divides by |y| + 1e-8; we
   use the exact masked mean (a relative difference of 1e-8, below float32 resolution).
5. Statistics: ``clip_high`` = adv > 0 and d > eps_high, ``clip_low`` = adv < 0 and d < −eps_low
   (tokens whose gradient the clip removes; verl's ``pg_clipfrac`` also counts tokens outside the
   range on the free side), and ``ratio`` = the unclipped geometric-mean ratio [b,G].
6. ``d`` and ``adv`` are zeroed outside the mask first (garbage padding never reaches the loss).
7. Token weights (``token_weights = "row:geo_mean"``, applied by the objective) [CODE] verl
   ``compute_policy_loss_geo_mean`` multiplies each row's loss by the sequence geometric mean of
   its ``rollout_is_weights``, exp(Σ_t log(w + 1e-10)·mask / (|y| + 1e-8)); here exp(mean_t log w)
   exactly, so a row with a weight-0 token (a ``top_entropy`` or MIS zero of scope ``"loss"``) gets
   factor 0, where verl's 1e-10 floor gives 1e-10^(k/|y|) (k zero tokens). A weight of scope
   ``"token"`` removes its zeros from ``mask`` instead (verl's rejection edits ``response_mask``):
   the means and the geometric mean then run over the kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import check_clip, loss_tokens, required, token_advantages
from groupwise.masked import masked_input, masked_mean
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("objective", "gmpo")
@dataclass
class GMPO:
    """Geometric-mean sequence ratio with token-wise log-space clipping (GMPO, Zhao et al. 2025)."""

    eps_low: float = 0.4
    eps_high: float = 0.4
    coef: float = 1.0
    agg: str | None = None

    needs = ()
    token_weights = "row:geo_mean"  # Note 7: verl's sequence geometric mean of the IS weights

    def __post_init__(self) -> None:
        if not self.eps_low >= 0.0:
            raise ValueError(f"gmpo: eps_low must be >= 0 (a log-ratio bound), got {self.eps_low}")
        check_clip("gmpo", 0.0, self.eps_high)

    def _inputs(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        mask = loss_tokens(mb)  # [b,G,T] verl's response_mask, rejected tokens removed (Note 7)
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        logp_old = masked_input(required(mb, "logp_old", "gmpo"), mask)  # [b,G,T]
        return logp - logp_old, token_advantages(mb, mask, "gmpo"), mask  # [b,G,T] x3

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        d, adv, mask = self._inputs(mb, out)  # [b,G,T], [b,G,T], [b,G,T]
        sgn = adv.sign()  # [b,G,T]
        d_clip = sgn * torch.minimum(sgn * d, sgn * d.clamp(-self.eps_low, self.eps_high))  # [b,G,T]
        ratio = torch.exp(masked_mean(d_clip, mask, dim=-1))  # [b,G]
        adv_s = masked_mean(adv, mask, dim=-1)  # [b,G]
        return -adv_s * ratio  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        d, adv, mask = self._inputs(mb, out)  # [b,G,T], [b,G,T], [b,G,T]
        d = d.detach()  # [b,G,T]
        return {
            "clip_high": ((d > self.eps_high) & (adv > 0)).float(),  # [b,G,T]
            "clip_low": ((d < -self.eps_low) & (adv < 0)).float(),  # [b,G,T]
            "ratio": torch.exp(masked_mean(d, mask, dim=-1)),  # [b,G]
        }
