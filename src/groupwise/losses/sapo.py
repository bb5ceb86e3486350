"""SAPO: a smooth, temperature-controlled sigmoid gate on the ratio instead of PPO's hard clip.

"Soft Adaptive Policy Optimization", Chang Gao, Chujie Zheng, Xiong-Hui Chen, Kai Dang, Shixuan
Liu, Bowen Yu, An Yang, Shuai Bai, Jingren Zhou, Junyang Lin, 2025. https://arxiv.org/abs/2511.20347
Reference implementation matched: TRL 1.16.0, ``trl/trainer/grpo_trainer.py``,
``GRPOTrainer._compute_loss`` with ``loss_type="sapo"`` (``importance_sampling_level="token"``, and
``"sequence"`` as ``level = "sequence"``).

**Change vs GRPO**

- ``min(ratio·adv, clip(ratio)·adv)`` becomes ``f(ratio)·adv`` with the soft gate
  f(r) = σ(τ(r − 1))·4/τ: near r = 1 it behaves like the ratio (f'(1) = 1), far from 1 its
  gradient decays smoothly instead of dropping to zero at a clip edge.
- Separate temperatures for positive and non-positive advantages (τ_neg > τ_pos: negative
  updates decay faster).

**Math** (per token; ``adv`` [b,G] is broadcast to [b,G,T])::

    ratio = exp(logp - logp_old)                                   level = "token"
          = exp(Σ_t mask·(logp - logp_old) / |y|) on every token  level = "sequence"
    tau   = tau_pos  where adv > 0,  tau_neg  elsewhere
    gate  = sigmoid(tau * (ratio - 1)) * 4 / tau
    loss  = -gate * adv
    d loss / d logp = -adv * ratio * 4 σ(1 - σ),   σ = sigmoid(tau * (ratio - 1))

**Defaults**

- ``tau_pos = 1.0``, ``tau_neg = 1.05`` [PAPER] the paper's recommended temperatures; [CODE] TRL
  ``sapo_temperature_pos=1.0``, ``sapo_temperature_neg=1.05``.
- ``level = "token"`` [PAPER] [CODE] TRL's default ``importance_sampling_level``; ``"sequence"``
  [CODE] TRL's sequence level (GSPO's length-normalised ratio, the paper's sequence-level variant), an option.
- Aggregation: use ``agg = "seq_mean_token_mean"`` (the project default) to match TRL, which
  aggregates ``sapo`` like ``grpo`` (mean over rows of each row's token mean) [CODE], and the
  paper's 1/G Σ_i 1/|y_i| Σ_t [PAPER].

**Notes**

1. The gate is smooth in the ratio: there is no clip boundary. At ratio = 1 the gate is
   σ(0)·4/τ = 2/τ and its slope is 4·σ(0)(1 − σ(0)) = 1, so on-policy the gradient is exactly
   REINFORCE's −adv·∇logp for either temperature (the loss value is −2adv/τ, not −adv).
2. ``tau`` is chosen by the sign of the (token) advantage with ``adv > 0`` → ``tau_pos`` and
   ``adv ≤ 0`` → ``tau_neg``, as TRL; adv = 0 gives loss 0 either way.
3. TRL counts rows with no loss tokens in the ``grpo`` denominator; ``seq_mean_token_mean`` counts
   only rows with ≥ 1 loss token (aggregation.py note 3): equal whenever every row has a token.
4. Statistics: ``ratio`` and ``gate_slope`` = 4σ(1 − σ) (the factor multiplying the unclipped
   PPO gradient −adv·∇ratio; 1 on-policy, → 0 far off-policy).
5. ``logp - logp_old`` is zeroed outside the mask before ``exp`` (padding never overflows).
6. ``level = "sequence"``: the gate reads the row's sequence ratio s (full autograd, TRL's form):
   ∇ of a row's token mean is −mean_t(adv_t·4σ_t(1 − σ_t))·s·∇mean_t logp, σ_t = sigmoid(tau_t(s − 1));
   on-policy still REINFORCE's for a sequence advantage. Statistics are per token of the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import ratio_and_adv, required, term_mask, token_advantages
from groupwise.masked import masked_input, masked_mean
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("objective", "sapo")
@dataclass
class SAPO:
    """Soft sigmoid gate σ(τ(r−1))·4/τ on the token ratio, τ by advantage sign (SAPO, Gao et al. 2025)."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    level: str = "token"  # "token" | "sequence"
    coef: float = 1.0
    agg: str | None = None

    needs = ()

    def __post_init__(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"sapo: {name} must be > 0, got {getattr(self, name)}")
        if self.level not in ("token", "sequence"):
            raise ValueError(f"sapo: level must be 'token' or 'sequence', got {self.level!r}")

    def _ratio_adv(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        if self.level == "token":
            return ratio_and_adv(mb, out, "sapo")  # [b,G,T], [b,G,T]
        mask = term_mask(mb)  # [b,G,T]
        d = masked_input(out["logp"], mask) - masked_input(required(mb, "logp_old", "sapo"), mask)  # [b,G,T]
        ratio = torch.exp(masked_mean(d, mask, dim=-1))[..., None].expand_as(d)  # [b,G,T] the row's sequence ratio
        return ratio, token_advantages(mb, mask, "sapo")  # [b,G,T], [b,G,T]

    def _sigma(self, ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
        tau = torch.where(adv > 0, self.tau_pos, self.tau_neg)  # [b,G,T]
        return torch.sigmoid(tau * (ratio - 1.0)), tau  # [b,G,T], [b,G,T]

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        ratio, adv = self._ratio_adv(mb, out)  # [b,G,T], [b,G,T]
        sig, tau = self._sigma(ratio, adv)  # [b,G,T], [b,G,T]
        gate = sig * 4.0 / tau  # [b,G,T]
        return -gate * adv  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv = self._ratio_adv(mb, out)  # [b,G,T], [b,G,T]
        sig, _ = self._sigma(ratio.detach(), adv)  # [b,G,T]
        return {"ratio": ratio.detach(), "gate_slope": 4.0 * sig * (1.0 - sig)}  # [b,G,T] each
