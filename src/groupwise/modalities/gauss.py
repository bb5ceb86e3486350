"""The Gaussian kernels the non-text policies share: a diagonal Gaussian's log-density and
classifier-free guidance of a velocity; the closed-form KL of two diagonal Gaussians.

Used by the flow toy's samplers (``modalities/flow_sde.py``: the Euler SDE step of Flow-GRPO /
Flash-GRPO and the consistency kernel of CM-GRPO, spec 19) and by the Gaussian policy kinds of the
non-text design (``../shared/design/nontext.md`` M3). Unit tests: specs 10 (−0.405792 and the ratio
1.377128), 26 (−0.55158 and the CFG mixes), ``tests/test_gauss.py``.

**Math** (x, μ [N,D]; σ [N] or [N,1] or a number)::

    gauss_logp = reduce_d[ −(x − μ)²/(2σ²) − log σ − ½·log 2π ]        reduce = mean (default) or sum
    cfg(v_u, v_c, w) = v_u + w·(v_c − v_u)                              (w = 0: v_u; w = 1: v_c)
    gauss_kl = Σ_d [ log(σ_p/σ_q) + (σ_q² + (μ_q − μ_p)²)/(2σ_p²) − ½ ]  KL(N(μ_q, σ_q²) ‖ N(μ_p, σ_p²))

``var`` may be given instead of recomputing σ² (the Euler SDE step passes std_t²·(−dt), the
product it always used, so its log-probs stay bit-identical).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
REDUCTIONS = ("mean", "sum")


def gauss_logp(x: Tensor, mean: Tensor, std: Tensor | float, reduce: str = "mean", var: Tensor | None = None) -> Tensor:
    """[N] the log-density of x [N,D] under N(mean [N,D], std²·I), reduced over D by ``reduce``."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"gauss_logp: reduce must be one of {REDUCTIONS}, got {reduce!r}")
    std = torch.as_tensor(std, dtype=mean.dtype)
    var = std**2 if var is None else var
    per_dim = -((x - mean) ** 2) / (2 * var) - torch.log(std) - LOG_SQRT_2PI  # [N,D]
    return per_dim.mean(-1) if reduce == "mean" else per_dim.sum(-1)  # [N]


def cfg_velocity(v_uncond: Tensor, v_cond: Tensor, w: float) -> Tensor:
    """Classifier-free guidance: v_u + w·(v_c − v_u) [N,D]."""
    return v_uncond + w * (v_cond - v_uncond)


def gauss_kl(mu_q: Tensor, sigma_q: Tensor | float, mu_p: Tensor, sigma_p: Tensor | float) -> Tensor:
    """KL(N(μ_q, σ_q² I) ‖ N(μ_p, σ_p² I)) [...] summed over the last axis (closed form; first user:
    paper 10's phase ``lac_align``, KL(q ‖ π_φ) of the latent actions)."""
    sq, sp = torch.as_tensor(sigma_q, dtype=mu_q.dtype), torch.as_tensor(sigma_p, dtype=mu_q.dtype)
    per_dim = torch.log(sp / sq) + (sq**2 + (mu_q - mu_p) ** 2) / (2 * sp**2) - 0.5  # [...,d]
    return per_dim.sum(-1)  # [...]
