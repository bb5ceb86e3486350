"""Flow-GRPO's SDE step with its Gaussian log-prob, the noise schedules (Flash-GRPO's and Flow-GRPO's),
CM-GRPO's consistency kernel, and ``row_labels`` (each flow row's own label): the maths of the flow
toy's sampler (``modalities/flow.py``) that components read too (``weights/flash_rectification.py``,
the rewards of ``modalities/flow_toy.py``), so it sits below both. The formulas are
``modalities/flow.py``'s **Math** and Note 9.

Flow-GRPO: "Flow-GRPO: Training Flow Matching Models via Online RL", Jie Liu, Gongye Liu, Jiajun
Liang et al., 2025, https://arxiv.org/abs/2505.05470; Flash-GRPO: arXiv 2605.15980, spec 14.
"""

from __future__ import annotations

import torch
from torch import Tensor

from groupwise.modalities.gauss import gauss_logp
from groupwise.types import Rollout

NOISE_SCHEDULES = ("flash", "flow_grpo")


def flow_sigmas(steps: int, shift: float = 1.0) -> Tensor:
    """[steps+1] float32 noise levels from 1 down to 0, time-shifted (SD3 / Wan ``shift``)."""
    u = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)  # [K+1]
    return (shift * u / (1 + (shift - 1) * u)).float()  # [K+1]


def noise_std(sigma: Tensor, sigma_min: float, sigma_max: float) -> Tensor:
    """std_t = σ_min + (σ_max − σ_min)·σ (Flash-GRPO's noise level)."""
    return sigma_min + (sigma_max - sigma_min) * sigma


def flow_grpo_noise_std(sigma: Tensor, sigma_max: float, noise_level: float = 0.7) -> Tensor:
    """std_t = a·√(σ / (1 − σ)) (Flow-GRPO's and Flow-OPD's noise level, ``a = noise_level``); at σ = 1
    the σ in the denominator is replaced by σ_max = sigmas[1], as the released code does
    (``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``, read at 54809b5), so the first step is finite."""
    return torch.sqrt(sigma / (1 - torch.where(sigma == 1, torch.as_tensor(sigma_max, dtype=sigma.dtype), sigma))) * (
        noise_level
    )


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
    schedule: str = "flash",
    noise_level: float = 0.7,
) -> tuple[Tensor, ...]:
    """One SDE step from σ to σ_prev (< σ) for v, x [N,D]; σ, σ_prev scalars or [N]; the noise level
    std_t of ``schedule``: ``"flash"`` (:func:`noise_std`) or ``"flow_grpo"`` (:func:`flow_grpo_noise_std`).

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
    if schedule not in NOISE_SCHEDULES:
        raise ValueError(f"sde_step_with_logprob: schedule must be one of {NOISE_SCHEDULES}, got {schedule!r}")
    std = (
        noise_std(s, sigma_min, sigma_max) if schedule == "flash" else flow_grpo_noise_std(s, sigma_max, noise_level)
    )  # [N,1]
    x64, v64 = x.double(), v.double()  # [N,D]
    mean = x64 * (1 + std**2 / (2 * s) * dt) + v64 * (1 + std**2 * (1 - s) / (2 * s)) * dt  # [N,D]
    if prev_sample is None:
        if noise is None:
            raise ValueError("sde_step_with_logprob: give prev_sample (to score a transition) or noise (to draw one)")
        prev_sample = (mean + std * sqrt_neg_dt * noise.double()).to(out)  # [N,D] as it will be stored
    prev_sample = prev_sample.detach()  # the action is data: only the mean carries gradient
    logp = gauss_logp(prev_sample.double(), mean, std * sqrt_neg_dt, var=std**2 * (-dt))  # [N] mean over D
    coe = 1 / rectification_coefficient(s, sp, std)  # [N,1]
    return prev_sample, logp.to(out), mean.to(out), std[:, 0].to(out), sqrt_neg_dt[:, 0].to(out), coe[:, 0].to(out)


def consistency_step(
    v: Tensor,
    x: Tensor,
    t: Tensor | float,
    s: Tensor | float,
    prev_sample: Tensor | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """One consistency-kernel step from noise level t to s (< t) for v, x [N,D] (CM-GRPO, spec 19):
    x̂₀ = x − t·v (rectified flow), then x_s = A(s)·x̂₀ + B(s)·ε with A(s) = 1 − s, B(s) = s, so
    π(x_s | x_t) = N(A(s)·x̂₀, B(s)²·I). Returns ``(x_s [N,D], logp [N], mean [N,D], std [N], x0 [N,D])``
    in x's dtype (maths in float64; logp the mean over D, NaN where s = 0: that last step is a
    deterministic map, never trained). Give ``prev_sample`` to score a stored step, else ``noise`` ε
    (zeros: the greedy, deterministic kernel)."""
    N, out = x.shape[0], x.dtype
    t64 = torch.as_tensor(t, dtype=torch.float64).expand(N)[:, None]  # [N,1]
    s64 = torch.as_tensor(s, dtype=torch.float64).expand(N)[:, None]  # [N,1]
    if not bool(((t64 > 0) & (s64 >= 0) & (s64 < t64)).all()):
        raise ValueError("consistency_step: need 0 <= s < t for every row (sampling runs from 1 down to 0)")
    x0 = x.double() - t64 * v.double()  # [N,D] x̂₀
    mean = (1 - s64) * x0  # [N,D] A(s)·x̂₀
    if prev_sample is None:
        if noise is None:
            raise ValueError("consistency_step: give prev_sample (to score a step) or noise (to draw one)")
        prev_sample = (mean + s64 * noise.double()).to(out)  # [N,D] as it will be stored
    prev_sample = prev_sample.detach()
    logp = gauss_logp(prev_sample.double(), mean, s64)  # [N]
    return prev_sample, logp.to(out), mean.to(out), s64[:, 0].to(out), x0.to(out)


def row_labels(rollout: Rollout) -> Tensor:
    """[B,G] int64: the label of every row's own context (``ctx`` when a strategy set one, else its
    group's prompt ``[label]``); 0 for padding rows without a context."""
    return torch.tensor([[int(c[0]) if c else 0 for c in row] for row in rollout.row_contexts()], dtype=torch.long)
