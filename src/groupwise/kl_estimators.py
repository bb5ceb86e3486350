"""KL estimators k1, k2, k3 (registry stage ``kl``), shared by objective terms and rewards.

"Approximating KL Divergence", John Schulman, blog post, 2020. http://joschu.net/blog/kl-approx.html

**Change vs GRPO**: none; GRPO uses k3 in its KL term (``losses/kl.py``).

**Math** (elementwise, samples drawn from π_θ, ``d = logp_ref - logp`` = log(π_ref / π_θ))::

    k1 = logp - logp_ref                 = -d              unbiased, high variance, can be < 0
    k2 = 0.5 * (logp - logp_ref)**2      = d²/2            biased, low variance, ≥ 0
    k3 = exp(d) - d - 1                                    unbiased, low variance, ≥ 0

**Defaults**: none (each estimator is parameter-free) [PAPER] Schulman 2020.

**Notes**

1. ``token_kl`` sets ``logp`` and ``logp_ref`` to 0 outside the mask before the estimator, so every
   estimator is exactly 0 there and padding cannot overflow ``exp``.
2. The gradients of each as a loss are discussed in ``losses/kl.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import masked_input
from groupwise.registry import register


@register("kl", "k1")
@dataclass
class K1:
    """Naive KL estimator logp − logp_ref (k1, Schulman 2020)."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return logp - logp_ref  # [...]


@register("kl", "k2")
@dataclass
class K2:
    """Squared log-ratio KL estimator ½(logp − logp_ref)² (k2, Schulman 2020)."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return 0.5 * (logp - logp_ref) ** 2  # [...]


@register("kl", "k3")
@dataclass
class K3:
    """Unbiased non-negative KL estimator e^d − d − 1, d = logp_ref − logp (k3, Schulman 2020; GRPO)."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        d = logp_ref - logp  # [...]
        return torch.exp(d) - d - 1.0  # [...]


def token_kl(estimator, logp: Tensor, logp_ref: Tensor, mask: Tensor) -> Tensor:
    """[b,G,T] float32 per-token KL estimate, exactly 0 outside ``mask``."""
    logp = masked_input(logp, mask)  # [b,G,T]
    logp_ref = masked_input(logp_ref, mask)  # [b,G,T]
    return estimator(logp, logp_ref)  # [b,G,T]
