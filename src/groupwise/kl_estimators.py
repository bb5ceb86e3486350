"""KL estimators (registry stage ``kl``), shared by objective terms and rewards.

"Approximating KL Divergence", John Schulman, blog post, 2020. http://joschu.net/blog/kl-approx.html
The ``abs``, ``low_var_kl`` and straight-through ``+`` forms follow verl
(``verl/trainer/ppo/core_algos.py``: ``kl_penalty``, ``kl_penalty_forward``; the ``+`` suffix came
with verl PR #2953, "Rollout-Training Mismatch Fix -- Truncated importance sampling", 2025).

**Change vs GRPO**: none; GRPO uses k3 in its KL term (``losses/kl.py``). The others are options.

**Math** (elementwise, samples drawn from π_θ, ``d = logp_ref - logp`` = log(π_ref / π_θ))::

    k1  = logp - logp_ref                = -d              unbiased, high variance, can be < 0
    k2  = 0.5 * (logp - logp_ref)**2     = d²/2            biased, low variance, ≥ 0
    k3  = exp(d) - d - 1                                    unbiased, low variance, ≥ 0
    abs = |logp - logp_ref|              = |d|             verl / TRL-PPO "abs"
    low_var_kl = clamp(exp(dc) - dc - 1, -10, 10),  dc = clamp(d, -20, 20)   verl's k3
    NAME+ = k2 - sg(k2) + sg(NAME)       value of NAME, gradient of k2 = (logp - logp_ref)·∇logp

(``sg`` = stop-gradient.) ``+`` forms registered: ``k1+``, ``k3+``, ``abs+``, ``low_var_kl+``.

**Defaults**: none (each estimator is parameter-free) [PAPER] Schulman 2020; the clamp bounds
±20 / ±10 of ``low_var_kl`` [CODE] verl ``kl_penalty_forward``.

**Notes**

1. ``token_kl`` sets ``logp`` and ``logp_ref`` to 0 outside the mask before the estimator, so every
   estimator is exactly 0 there and padding cannot overflow ``exp``.
2. Why ``+``: as a loss, ∇k2 = (logp − logp_ref)·∇logp has expectation ∇KL(π_θ ‖ π_ref) exactly,
   while ∇k1 has expectation 0 and ∇k3 that of the *other* KL (see ``losses/kl.py`` note 2). The
   straight-through form logs/penalises the value of NAME but trains with k2's gradient. verl
   names k2 ``mse`` and k1 ``kl``; ``k2+`` would be k2 itself (verl excludes it), so it is not here.
3. verl at commit b178a3c (2026-01) passes the suffixed name on to ``kl_penalty_forward``, which
   has no branch for it and raises ``NotImplementedError``: the ``+`` forms here implement what its
   ``kl_penalty`` docstring and ``docs/algo/grpo.md`` describe.
4. ``low_var_kl`` equals ``k3`` for −10.99998 < d < 2.61087 (k3 ≤ 10); outside, its value is capped
   at 10 and its gradient is 0. The importance-weighted (bias-corrected) k3 of TRL 1.16 is an
   option of the objective term (``kl(bias_correction=true)``): it needs ``logp_old``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.masked import masked_input
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


@register("kl", "abs")
@dataclass
class Abs:
    """Absolute log-ratio |logp − logp_ref| (verl / TRL-PPO ``kl_penalty="abs"``)."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return (logp - logp_ref).abs()  # [...]


@register("kl", "low_var_kl")
@dataclass
class LowVarKL:
    """verl's clamped k3: d clipped to ±20, value clipped to ±10 (verl ``kl_penalty="low_var_kl"``)."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        d = (logp_ref - logp).clamp(-20.0, 20.0)  # [...]
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)  # [...]


def straight_through(value: Tensor, logp: Tensor, logp_ref: Tensor) -> Tensor:
    """[...] the value of ``value`` with the gradient of k2 = ½(logp − logp_ref)²."""
    k2 = 0.5 * (logp - logp_ref) ** 2  # [...]
    return k2 - k2.detach() + value.detach()  # [...]


@register("kl", "k1+")
@dataclass
class K1Plus:
    """k1's value with k2's gradient, straight through (verl ``kl_loss_type="k1+"``)."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return straight_through(K1()(logp, logp_ref), logp, logp_ref)  # [...]


@register("kl", "k3+")
@dataclass
class K3Plus:
    """k3's value with k2's gradient, straight through (verl ``kl_loss_type="k3+"``)."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return straight_through(K3()(logp, logp_ref), logp, logp_ref)  # [...]


@register("kl", "abs+")
@dataclass
class AbsPlus:
    """|logp − logp_ref| with k2's gradient, straight through (verl ``kl_loss_type="abs+"``)."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return straight_through(Abs()(logp, logp_ref), logp, logp_ref)  # [...]


@register("kl", "low_var_kl+")
@dataclass
class LowVarKLPlus:
    """verl's clamped k3 value with k2's gradient, straight through (verl ``"low_var_kl+"``)."""

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        return straight_through(LowVarKL()(logp, logp_ref), logp, logp_ref)  # [...]


def token_kl(estimator, logp: Tensor, logp_ref: Tensor, mask: Tensor) -> Tensor:
    """[b,G,T] float32 per-token KL estimate, exactly 0 outside ``mask``."""
    logp = masked_input(logp, mask)  # [b,G,T]
    logp_ref = masked_input(logp_ref, mask)  # [b,G,T]
    return estimator(logp, logp_ref)  # [b,G,T]
