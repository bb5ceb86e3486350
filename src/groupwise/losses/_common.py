"""Shared input handling for objective terms (not a component: no ``@register``).

Every term reads the same few fields of a micro-batch; these helpers give them one behaviour:
float32 (DESIGN §7), advantages broadcast to tokens, and padding positions neutralised *before*
any non-linearity, so that garbage (even inf/NaN) at masked positions can never reach the loss
value or leak into the gradient through ``0 · inf``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from groupwise.types import Rollout


def term_mask(mb: Rollout) -> Tensor:
    """[b,G,T] bool: completion tokens of valid rows (weights are applied later by the objective)."""
    return mb.row_mask.bool()  # [b,G,T]


def masked_input(x: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """[b,G,T] float32 copy of ``x`` with ``fill`` outside ``mask`` (gradient flows only inside)."""
    x = x.float()  # [b,G,T]
    return torch.where(mask, x, torch.full((), fill, dtype=x.dtype))  # [b,G,T]


def token_advantages(mb: Rollout, mask: Tensor, who: str) -> Tensor:
    """[b,G,T] float32 advantages: a [b,G] sequence advantage broadcast to every token, 0 outside mask."""
    if mb.advantages is None:
        raise ValueError(f"objective term {who!r} needs rollout.advantages; configure an advantage estimator")
    adv = mb.advantages.float()  # [b,G] or [b,G,T]
    if adv.dim() == 2:
        adv = adv[..., None].expand(mask.shape)  # [b,G,T]
    elif adv.dim() != 3:
        raise ValueError(f"{who}: advantages must be [B,G] or [B,G,T], got {tuple(adv.shape)}")
    return masked_input(adv, mask)  # [b,G,T]


def required(mb: Rollout, field: str, who: str) -> Tensor:
    value = getattr(mb, field)
    if value is None:
        raise ValueError(f"objective term {who!r} needs rollout.{field}, which the trainer did not fill")
    return value
