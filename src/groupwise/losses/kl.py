"""KL estimators k1, k2, k3 and the KL-to-reference objective term.

"Approximating KL Divergence", John Schulman, blog post, 2020.
http://joschu.net/blog/kl-approx.html — the term as used by GRPO: "DeepSeekMath", Shao et al.
2024, https://arxiv.org/abs/2402.03300 (eq. 4, unbiased estimator with β = 0.04).

**Change vs GRPO**: none (GRPO adds β·KL(π_θ ‖ π_ref) to the loss with the k3 estimator); the
estimator is selectable: stage ``kl`` (module ``groupwise.kl_estimators``) holds every estimator so
other components (the ``kl_penalty`` reward, adaptive-KL variants) reuse them by name without
importing the loss.

**Math** (elementwise, samples drawn from π_θ, ``d = logp_ref - logp`` = log(π_ref / π_θ))::

    k1 = logp - logp_ref                 = -d              unbiased, high variance, can be < 0
    k2 = 0.5 * (logp - logp_ref)**2      = d²/2            biased, low variance, ≥ 0
    k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1
       = exp(d) - d - 1                                    unbiased, low variance, ≥ 0

**Defaults**

- ``coef = 0.04`` [PAPER] DeepSeekMath's β.
- ``estimator = "k3"`` [PAPER] DeepSeekMath eq. 4 is k3; [CODE] TRL uses the same per-token form.

**Notes**

1. ``logp`` and ``logp_ref`` are set to 0 outside the mask before the estimator, so every
   estimator is exactly 0 there and padding cannot overflow ``exp``.
2. As a loss (samples held fixed): ∇k1 = ∇logp, whose expectation under π_θ is 0, so k1 is
   for rewards (``kl_penalty``), not losses; ∇k2 = (logp − logp_ref)·∇logp, whose expectation is
   exactly ∇KL(π_θ ‖ π_ref); ∇k3 = (1 − exp(d))·∇logp, whose expectation is ∇KL(π_ref ‖ π_θ)
   (derivation: Σ_y ∇π = 0). GRPO uses k3 regardless.
3. ``stats`` reports the per-token KL (estimator value), averaged over loss tokens by the
   objective as ``kl``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.kl_estimators import token_kl
from groupwise.losses._common import required, term_mask
from groupwise.registry import build, register
from groupwise.types import Need, Rollout, StepInfo


@register("objective", "kl")
@dataclass
class KLTerm:
    """Per-token KL penalty to the reference policy, k3 by default (GRPO, Shao et al. 2024)."""

    coef: float = 0.04
    estimator: str = "k3"
    agg: str | None = None

    needs = (Need("logp", model="ref"),)
    weighted = False  # token weights (top-entropy, IS corrections) scale the policy-gradient terms only, as in TRL

    def __post_init__(self) -> None:
        self._kl = build("kl", self.estimator)

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        logp_ref = required(mb, "logp_ref", "kl")  # [b,G,T]
        return token_kl(self._kl, out["logp"], logp_ref, term_mask(mb))  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        logp_ref = required(mb, "logp_ref", "kl")  # [b,G,T]
        kl = token_kl(self._kl, out["logp"], logp_ref, term_mask(mb))  # [b,G,T]
        return {"kl": kl.detach()}
