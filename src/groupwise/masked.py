"""Masked reductions and group primitives shared by every component. Group statistics reduce over
``dim=1`` (the group); the primitives force exact zeros for invalid rows and constant groups.

The group primitives (``valid_rows``, ``group_*``, ``batch_std``) work in float64: in float32 the
squared deviations overflow once |r| exceeds about 1.8e19, and a group's sum once it exceeds 3.4e38.
Estimators cast their advantages back with :func:`to_float32`."""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_SCALES = ("group", "batch", "none")
_F32_MAX = float(torch.finfo(torch.float32).max)


def masked_sum(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Mean over ``mask``; 0 (not NaN) where nothing is selected."""
    n = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / n.clamp(min=1).to(x.dtype)


def masked_input(x: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """[b,G,T] float32 copy of ``x`` with ``fill`` outside ``mask`` (gradient flows only inside): padding
    neutralised before any non-linearity, so garbage there (even inf/NaN) never reaches a value or a
    gradient through ``0 · inf``."""
    x = x.float()  # [b,G,T]
    return torch.where(mask, x, torch.full((), fill, dtype=x.dtype))  # [b,G,T]


def masked_logsumexp(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    """log Σ over ``mask`` of exp(x) along ``dim`` (kept), −inf where nothing is selected; the
    gradient is exactly 0 outside ``mask`` and finite everywhere (no NaN from an empty selection)."""
    has = mask.any(dim, keepdim=True)
    z = torch.where(mask, x, torch.full((), -torch.inf, dtype=x.dtype))
    z = torch.where(has, z, torch.zeros((), dtype=x.dtype))  # an empty selection: a constant, no gradient
    lse = torch.logsumexp(z, dim, keepdim=True)
    return torch.where(has, lse, torch.full((), -torch.inf, dtype=x.dtype))


def group_log_softmax(x: Tensor, members: Tensor) -> Tensor:
    """[B,G] log-softmax over each group's ``members`` (dim 1); 0 outside them (a distribution on
    the group's members: one member has log-probability 0)."""
    out = x - masked_logsumexp(x, members, dim=1)  # [B,G]
    return torch.where(members, out, torch.zeros((), dtype=x.dtype))  # [B,G]


def to_float32(x: Tensor) -> Tensor:
    """float64 advantages -> float32, saturating at ±3.4e38 (float32's largest) instead of becoming
    ±inf: an unscaled advantage of huge rewards (r − mean, 2r − 1) may not fit in float32."""
    return x.clamp(-_F32_MAX, _F32_MAX).float()


def group_mean(x: Tensor, valid: Tensor) -> Tensor:
    """[B,G] -> [B,1] float64 mean over each group's valid rows (0 for an empty group)."""
    return masked_mean(x.double(), valid, dim=1)[:, None]


def group_std(x: Tensor, valid: Tensor, ddof: int = 1) -> Tensor:
    """[B,G] -> [B,1] float64 std over valid rows. ``ddof=1`` is Bessel-corrected (torch.std, TRL,
    verl); ``ddof=0`` the population std (numpy). Groups with ``n <= ddof`` get std 0, never NaN."""
    x = x.double()  # [B,G]
    n = valid.sum(1, keepdim=True).to(x.dtype)  # [B,1]
    dev = torch.where(valid, x - group_mean(x, valid), torch.zeros((), dtype=x.dtype))  # [B,G]
    var = (dev**2).sum(1, keepdim=True) / (n - ddof).clamp(min=1)  # [B,1]
    return torch.where(n > ddof, var.sqrt(), torch.zeros_like(var))


def batch_std(x: Tensor, valid: Tensor, ddof: int = 1) -> Tensor:
    """Scalar float64 std over every valid entry of the batch."""
    x = x.double()  # [...]
    n = valid.sum().to(x.dtype)
    mean = masked_mean(x, valid)
    dev = torch.where(valid, x - mean, torch.zeros((), dtype=x.dtype))
    var = (dev**2).sum() / (n - ddof).clamp(min=1)
    return torch.where(n > ddof, var.sqrt(), torch.zeros_like(var))


def finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))


def valid_rows(rollout) -> tuple[Tensor, Tensor]:
    """(rewards [B,G] float64, valid [B,G] bool): the rows that enter group statistics."""
    if rollout.rewards is None:
        raise ValueError("advantage estimators need rollout.rewards; run the reward stage first")
    r = rollout.rewards.double()  # [B,G] exact copy of the float32 rewards
    if r.dim() != 2:
        raise ValueError(f"advantage estimators expect rewards [B,G], got {tuple(r.shape)}")
    valid = rollout.group_valid.bool() & torch.isfinite(r)  # [B,G]
    return r, valid


def constant_group(r: Tensor, valid: Tensor) -> Tensor:
    """[B,1] bool: the group's valid rewards are all equal (true for 0 or 1 valid rows)."""
    hi = torch.where(valid, r, torch.full_like(r, -torch.inf)).amax(1, keepdim=True)  # [B,1]
    lo = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(1, keepdim=True)  # [B,1]
    return ~(hi > lo)  # [B,1]


def group_center(r: Tensor, valid: Tensor) -> Tensor:
    """[B,G] float64 r - mean_g(r) over valid rows; exactly 0 for invalid rows and constant groups."""
    r = r.double()  # [B,G]
    centred = r - group_mean(r, valid)  # [B,G]
    keep = valid & ~constant_group(r, valid)  # [B,G]
    return torch.where(keep, centred, torch.zeros((), dtype=r.dtype))  # [B,G]


def group_normalize(r: Tensor, valid: Tensor, scale: str | None = "group", ddof: int = 1, eps: float = 1e-4) -> Tensor:
    """[B,G] -> [B,G] float64, centred by the group mean, divided by the group / batch std (+eps) or not at all."""
    centred = group_center(r, valid)  # [B,G]
    if scale in (None, "none"):
        return centred
    if scale == "group":
        std = group_std(r, valid, ddof)  # [B,1]
    elif scale == "batch":
        std = batch_std(r, valid, ddof)  # []
    else:
        raise ValueError(f"scale must be one of {GROUP_SCALES}, got {scale!r}")
    denom = std + eps  # [B,1] or []
    # eps=0 and std=0 only for constant groups (centred 0)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    return centred / denom  # [B,G]
