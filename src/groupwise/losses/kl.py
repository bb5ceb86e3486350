"""The KL-to-reference objective term, with any estimator of stage ``kl`` and TRL's bias correction.

"Approximating KL Divergence", John Schulman, blog post, 2020.
http://joschu.net/blog/kl-approx.html — the term as used by GRPO: "DeepSeekMath", Shao et al.
2024, https://arxiv.org/abs/2402.03300 (eq. 4, unbiased estimator with β = 0.04). The
importance-weighted form: "DeepSeek-V3.2", DeepSeek-AI 2025, https://arxiv.org/abs/2512.02556,
as TRL 1.16 implements it (``trl/trainer/grpo_trainer.py`` ``GRPOTrainer._compute_loss``,
``GRPOConfig.use_bias_correction_kl``).

**Change vs GRPO**: none by default (GRPO adds β·KL(π_θ ‖ π_ref) to the loss with the k3
estimator). The estimator is selectable: stage ``kl`` (module ``groupwise.kl_estimators``: k1, k2,
k3, abs, low_var_kl and the straight-through ``k1+``, ``k3+``, ``abs+``, ``low_var_kl+``) holds
every estimator so other components (the ``kl_penalty`` reward, adaptive-KL controllers) reuse
them by name. ``bias_correction = true`` multiplies the per-token estimate by the importance ratio
π_θ/π_old, as TRL 1.16 does by default.

**Math** (elementwise, samples drawn from π_old, ``d = logp_ref - logp`` = log(π_ref / π_θ))::

    k3    = exp(logp_ref - logp) - (logp_ref - logp) - 1 = exp(d) - d - 1    (any ``estimator``)
    loss  = kl(logp, logp_ref)                                    bias_correction = false
    ratio = exp(logp - logp_old)                                  is_level = "token"
          = exp(Σ_t mask·(logp - logp_old) / Σ_t mask)            is_level = "sequence" (per row)
    loss  = ratio · kl(logp, logp_ref)                            bias_correction = true

``ratio`` keeps its gradient: on-policy (ratio = 1) ∇(ratio·k3) = (1 − e^d + k3)·∇logp
= (logp − logp_ref)·∇logp = ∇k2, the unbiased gradient of KL(π_θ ‖ π_ref).

**Defaults**

- ``coef = 0.04`` [PAPER] DeepSeekMath's β. (TRL 1.16 ``GRPOConfig.beta = 0.0``: no KL term.)
- ``estimator = "k3"`` [PAPER] DeepSeekMath eq. 4 is k3; [CODE] TRL 1.16 computes the same per-token
  k3 ``exp(ref − logp) − (ref − logp) − 1``, then, by default, multiplies it by the ratio.
- ``bias_correction = False`` [PAPER] DeepSeekMath's plain k3 (groupwise's numbers before this
  option). This equals TRL 1.16 only with ``use_bias_correction_kl=False``; TRL's default is
  ``use_bias_correction_kl=True``, i.e. ``bias_correction = true`` here [CODE].
- ``is_level = "token"`` [CODE] TRL ``importance_sampling_level = "token"``; ``"sequence"`` is
  TRL's GSPO setting, where the ratio is exp of the row's mean log-ratio.

**Notes**

1. ``logp``, ``logp_ref`` and ``logp_old`` are set to 0 outside the mask before the estimator, so
   every estimate and ratio is neutral there (0 and 1) and padding cannot overflow ``exp``.
2. As a loss (samples held fixed): ∇k1 = ∇logp, whose expectation under π_θ is 0, so k1 is
   for rewards (``kl_penalty``), not losses; ∇k2 = (logp − logp_ref)·∇logp, whose expectation is
   exactly ∇KL(π_θ ‖ π_ref); ∇k3 = (1 − exp(d))·∇logp, whose expectation is ∇KL(π_ref ‖ π_θ)
   (derivation: Σ_y ∇π = 0). GRPO uses k3 regardless; ``k3+`` or ``bias_correction`` fix this.
3. ``stats`` reports the term's per-token value (the estimate, times the ratio when
   ``bias_correction``), averaged over loss tokens by the objective as ``kl`` — what TRL logs as
   ``kl``.
4. Exempt from token weights (``token_weights = "exempt"``): TRL multiplies its vLLM importance ratio, off-policy mask
   and entropy mask into the policy loss only and adds ``beta · per_token_kl`` afterwards; verl
   adds its KL loss separately from ``rollout_is_weights`` likewise.
5. ``bias_correction`` reads ``mb.logp_old``, which the trainer always fills before the loss (from
   the first pass when training is on-policy), so no extra ``Need`` is declared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.kl_estimators import token_kl
from groupwise.losses._common import required, term_mask
from groupwise.masked import masked_input, masked_mean
from groupwise.registry import build, register
from groupwise.types import Need, Rollout, StepInfo

IS_LEVELS = ("token", "sequence")


@register("objective", "kl")
@dataclass
class KLTerm:
    """Per-token KL penalty to the reference policy, k3 by default (GRPO, Shao et al. 2024)."""

    coef: float = 0.04
    estimator: str = "k3"
    bias_correction: bool = False  # TRL 1.16 use_bias_correction_kl (its default: True)
    is_level: str = "token"
    agg: str | None = None

    needs = (Need("logp", model="ref"),)
    token_weights = "exempt"  # Note 4: token weights (top-entropy, IS corrections) scale the policy-gradient terms only

    def __post_init__(self) -> None:
        self._kl = build("kl", self.estimator)
        if self.is_level not in IS_LEVELS:
            raise ValueError(f"kl: is_level must be one of {', '.join(IS_LEVELS)}, got {self.is_level!r}")

    def _values(self, mb: Rollout, out: dict[str, Tensor]) -> Tensor:
        mask = term_mask(mb)  # [b,G,T]
        logp_ref = required(mb, "logp_ref", "kl")  # [b,G,T]
        kl = token_kl(self._kl, out["logp"], logp_ref, mask)  # [b,G,T]
        if not self.bias_correction:
            return kl
        log_ratio = masked_input(out["logp"], mask) - masked_input(required(mb, "logp_old", "kl"), mask)  # [b,G,T]
        if self.is_level == "sequence":
            log_ratio = masked_mean(log_ratio, mask, dim=-1)[..., None]  # [b,G,1]
        return torch.exp(log_ratio) * kl  # [b,G,T]

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        return self._values(mb, out)  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"kl": self._values(mb, out).detach()}  # [b,G,T]
