"""Masked reductions shared by every component. Group statistics reduce over ``dim=1`` (the group)."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Mean over ``mask``; 0 (not NaN) where nothing is selected."""
    n = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / n.clamp(min=1).to(x.dtype)


def group_mean(x: Tensor, valid: Tensor) -> Tensor:
    """[B,G] -> [B,1] mean over each group's valid rows (0 for an empty group)."""
    return masked_mean(x, valid, dim=1)[:, None]


def group_std(x: Tensor, valid: Tensor, ddof: int = 1) -> Tensor:
    """[B,G] -> [B,1] std over valid rows. ``ddof=1`` is Bessel-corrected (torch.std, TRL, verl);
    ``ddof=0`` the population std (numpy). Groups with ``n <= ddof`` get std 0, never NaN."""
    n = valid.sum(1, keepdim=True).to(x.dtype)  # [B,1]
    dev = torch.where(valid, x - group_mean(x, valid), torch.zeros((), dtype=x.dtype))  # [B,G]
    var = (dev**2).sum(1, keepdim=True) / (n - ddof).clamp(min=1)  # [B,1]
    return torch.where(n > ddof, var.sqrt(), torch.zeros_like(var))


def batch_std(x: Tensor, valid: Tensor, ddof: int = 1) -> Tensor:
    """Scalar std over every valid entry of the batch."""
    n = valid.sum().to(x.dtype)
    mean = masked_mean(x, valid)
    dev = torch.where(valid, x - mean, torch.zeros((), dtype=x.dtype))
    var = (dev**2).sum() / (n - ddof).clamp(min=1)
    return torch.where(n > ddof, var.sqrt(), torch.zeros_like(var))


def finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))
