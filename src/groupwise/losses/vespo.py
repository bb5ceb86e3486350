"""VESPO: REINFORCE weighted by a gamma-shaped kernel of the *unnormalised* sequence IS weight.

"VESPO: Variational Sequence-Level Soft Policy Optimization for Stable Off-Policy LLM Training",
Guobin Shen, Chenxiao Zhao, Xiang Cheng, Lei Huang, Xing Yu, 2026. https://arxiv.org/abs/2602.10693
— authors' code: github.com/FloyedShen/VESPO ``recipe/vespo/code/core_algos.py``
(``compute_policy_loss_vespo``). Reference implementation matched: TRL 1.16.0,
``trl/trainer/grpo_trainer.py``, ``GRPOTrainer.get_gamma_weights`` and ``_compute_loss`` with
``loss_type="vespo"``.

**Change vs GRPO**

- No ratio in the graph and no clip: the gradient is φ(w)·adv·∇logp with φ detached.
- w is the full sequence likelihood ratio Π_t π/π_old (a sum of log-ratios, no 1/|y|); the kernel
  φ(w) = e^λ·w^k·e^{−λw} (φ(1) = 1) damps both w ≪ 1 (power k) and w ≫ 1 (decay λ), with
  separate (k, λ) for non-negative and negative advantages.

**Math** (``mask`` = completion tokens of valid rows)::

    log_w = clip(Σ_t mask·clip(logp - logp_old, -20, 20) [+ Σ_t mask·log_is], log 1e-8, 20)   # [b,G]
    w     = exp(log_w)
    k, lam = (k_pos, lambda_pos) where adv >= 0, (k_neg, lambda_neg) elsewhere               # per token
    phi   = sg[exp(lam + k·log_w - lam·w)]          (NaN/inf → 0)                            # [b,G,T]
    loss  = -phi * adv * logp                                                                # [b,G,T]
    log_is = clip(log(is), log 1e-8, 20),  is = TRL's token IS ratio exp(logp_old - logp_sampler)
             truncated ("token_truncate") or zeroed outside [is_min, is_max] ("token_mask")

**Defaults**

- ``k_pos = 2.0``, ``lambda_pos = 3.0``, ``k_neg = 3.0``, ``lambda_neg = 2.0`` [CODE] TRL
  ``vespo_*`` defaults and the authors' ``core_algos.py`` values (its docstring lists other
  numbers — 1.5, 4.0, 2.5 — that the code does not use).
- ``sampler_is = None`` (off) [CODE] TRL applies it only with vLLM IS correction on; ``is_min =
  None``, ``is_max = 3.0`` [CODE] TRL ``vllm_importance_sampling_clip_min/max``.
- Aggregation: use ``agg = "token_mean"`` to match TRL (Σ loss·mask / ``num_items_in_batch``)
  [CODE] and the authors' verl default ``loss_agg_mode="token-mean"`` [CODE].

**Notes**

1. On-policy log_w = 0, w = 1 and φ = e^{λ−λ} = 1 exactly: the gradient is REINFORCE's.
2. The clamps are TRL's: per-token log-ratio to [−20, 20], the sequence log-weight to
   [log 1e-8, 20] (the authors' code clamps to [−20, 20] and floors w at 1e-8 inside the log: the
   same φ up to λ·(1e-8 − e^−20)).
3. (k, λ) follow the sign of each token's advantage (TRL); with sequence advantages φ is one value
   per row. λ is floored at 1e-4 as TRL. adv = 0 selects the positive pair (loss 0 anyway).
4. ``sampler_is`` folds TRL's vLLM importance-sampling correction into w (TRL excludes ``vespo``
   from its usual per-token multiplication); it reads ``rollout.logp_sampler``. Do not combine
   it with a separate sampler-IS token weight. NaN sampler log-probs count as ratio 1 (TRL).
   TRL sums log_is over every position (its padding ratio is 1); we sum over the mask, which
   differs only when ``is_min > 1``.
5. The loss *value* is −φ·adv·logp (TRL's); only its gradient is meaningful as an objective.
6. Statistics: ``phi`` (token mean; TRL logs ``vespo/phi_seq_mean`` per sequence) and ``log_w`` [b,G].
7. Inputs are zeroed outside the mask first (garbage padding never reaches the loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import required, term_mask, token_advantages
from groupwise.masked import masked_input, masked_sum
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

LOG_FLOOR = math.log(1e-8)  # TRL's lower clamp of every log-weight
SAMPLER_IS = (None, "token_truncate", "token_mask")


@register("objective", "vespo")
@dataclass
class VESPO:
    """Detached gamma kernel φ(w) of the sequence IS weight times REINFORCE (VESPO, Shen et al. 2026)."""

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0
    sampler_is: str | None = None
    is_min: float | None = None
    is_max: float | None = 3.0
    coef: float = 1.0
    agg: str | None = None

    needs = ()

    @property
    def reads_sampler_logp(self) -> bool:  # its sampler_is option reads logp_sampler (build.check_policy_fit)
        return self.sampler_is is not None

    def __post_init__(self) -> None:
        if self.sampler_is not in SAMPLER_IS:
            raise ValueError(f"vespo: sampler_is must be one of {SAMPLER_IS}, got {self.sampler_is!r}")
        for name in ("k_pos", "k_neg", "lambda_pos", "lambda_neg"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"vespo: {name} must be >= 0, got {getattr(self, name)}")

    def _log_is(self, mb: Rollout, mask: Tensor) -> Tensor:
        diff = masked_input(mb.logp_old, mask) - masked_input(required(mb, "logp_sampler", "vespo"), mask)  # [b,G,T]
        is_ratio = torch.exp(torch.nan_to_num(diff, nan=0.0))  # [b,G,T]
        lo = -math.inf if self.is_min is None else self.is_min
        hi = math.inf if self.is_max is None else self.is_max
        if self.sampler_is == "token_truncate":
            is_ratio = is_ratio.clamp(lo, hi)  # [b,G,T]
        else:
            is_ratio = torch.where((is_ratio < lo) | (is_ratio > hi), 0.0, is_ratio)  # [b,G,T]
        return masked_sum(torch.log(is_ratio).clamp(LOG_FLOOR, 20.0), mask, dim=-1)  # [b,G]

    def _phi(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mask = term_mask(mb)  # [b,G,T]
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        with torch.no_grad():
            d = (logp - masked_input(required(mb, "logp_old", "vespo"), mask)).clamp(-20.0, 20.0)  # [b,G,T]
            log_w = masked_sum(d, mask, dim=-1)  # [b,G]
            if self.sampler_is is not None:
                log_w = log_w + self._log_is(mb, mask)  # [b,G]
            log_w = log_w.clamp(LOG_FLOOR, 20.0)  # [b,G]
        adv = token_advantages(mb, mask, "vespo")  # [b,G,T]
        nonneg = adv >= 0  # [b,G,T]
        k = torch.where(nonneg, self.k_pos, self.k_neg)  # [b,G,T]
        lam = torch.where(nonneg, self.lambda_pos, self.lambda_neg).clamp(min=1e-4)  # [b,G,T]
        log_phi = lam + k * log_w[..., None] - lam * log_w.exp()[..., None]  # [b,G,T]
        phi = torch.nan_to_num(log_phi.exp(), nan=0.0, posinf=0.0, neginf=0.0)  # [b,G,T]
        return phi, adv, logp, log_w

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        phi, adv, logp, _ = self._phi(mb, out)  # [b,G,T] x3
        return -phi * adv * logp  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        phi, _, _, log_w = self._phi(mb, out)  # [b,G,T], [b,G]
        return {"phi": phi, "log_w": log_w}  # [b,G,T], [b,G]
