"""Flow-GRPO's SDE step with its Gaussian log-prob, and the noise schedule: the maths of the flow
toy's sampler (``modalities/flow.py``) that a token weight reads too (``weights/flash_rectification.py``),
so it sits below both. The formulas are ``modalities/flow.py``'s **Math**.

Flow-GRPO: "Flow-GRPO: Training Flow Matching Models via Online RL", Jie Liu, Gongye Liu, Jiajun
Liang et al., 2025, https://arxiv.org/abs/2505.05470; Flash-GRPO: arXiv 2605.15980, spec 14.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def flow_sigmas(steps: int, shift: float = 1.0) -> Tensor:
    """[steps+1] float32 noise levels from 1 down to 0, time-shifted (SD3 / Wan ``shift``)."""
    u = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)  # [K+1]
    return (shift * u / (1 + (shift - 1) * u)).float()  # [K+1]


def noise_std(sigma: Tensor, sigma_min: float, sigma_max: float) -> Tensor:
    """std_t = σ_min + (σ_max − σ_min)·σ (Flash-GRPO's noise level)."""
    return sigma_min + (sigma_max - sigma_min) * sigma


def rectification_coefficient(sigma: Tensor, sigma_prev: Tensor, std_t: Tensor) -> Tensor:
    """c(t) = √(−dt)/std_t + std_t √(−dt)(1−σ)/(2σ), the scale of ∂logp/∂v; coe = 1/c."""
    sqrt_neg_dt = torch.sqrt(sigma - sigma_prev)
    return sqrt_neg_dt / std_t + std_t * sqrt_neg_dt * (1 - sigma) / (2 * sigma)


def sde_step_with_logprob(
    v: Tensor,
    x: Tensor,
    sigma: Tensor | float,
    sigma_prev: Tensor | float,
    sigma_min: float,
    sigma_max: float,
    prev_sample: Tensor | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """One SDE step from σ to σ_prev (< σ) for v, x [N,D]; σ, σ_prev scalars or [N].

    Returns ``(x_prev [N,D], logp [N], mean [N,D], std_t [N], sqrt_neg_dt [N], coe [N])`` in x's
    dtype; the maths runs in float64. Give ``prev_sample`` to score a stored transition, else
    ``noise`` ε [N,D] to draw one (x_prev is rounded to x's dtype before it is scored)."""
    N, out = x.shape[0], x.dtype
    s = torch.as_tensor(sigma, dtype=torch.float64).expand(N)[:, None]  # [N,1]
    sp = torch.as_tensor(sigma_prev, dtype=torch.float64).expand(N)[:, None]  # [N,1]
    if not bool(((s > 0) & (sp >= 0) & (sp < s)).all()):
        raise ValueError(
            "sde_step_with_logprob: need 0 <= sigma_prev < sigma for every row (sampling runs from sigma 1 down to 0)"
        )
    dt = sp - s  # [N,1] < 0
    sqrt_neg_dt = torch.sqrt(-dt)  # [N,1]
    std = noise_std(s, sigma_min, sigma_max)  # [N,1]
    x64, v64 = x.double(), v.double()  # [N,D]
    mean = x64 * (1 + std**2 / (2 * s) * dt) + v64 * (1 + std**2 * (1 - s) / (2 * s)) * dt  # [N,D]
    if prev_sample is None:
        if noise is None:
            raise ValueError("sde_step_with_logprob: give prev_sample (to score a transition) or noise (to draw one)")
        prev_sample = (mean + std * sqrt_neg_dt * noise.double()).to(out)  # [N,D] as it will be stored
    prev_sample = prev_sample.detach()  # the action is data: only the mean carries gradient
    logp = (
        -((prev_sample.double() - mean) ** 2) / (2 * std**2 * (-dt)) - torch.log(std * sqrt_neg_dt) - _LOG_SQRT_2PI
    ).mean(-1)  # [N]
    coe = 1 / rectification_coefficient(s, sp, std)  # [N,1]
    return prev_sample, logp.to(out), mean.to(out), std[:, 0].to(out), sqrt_neg_dt[:, 0].to(out), coe[:, 0].to(out)
