"""Shared input handling for objective terms (not a component: no ``@register``).

Every term reads the same few fields of a micro-batch; these helpers give them one behaviour:
float32 (DESIGN §7), advantages broadcast to tokens, and padding positions neutralised *before*
any non-linearity, so that garbage (even inf/NaN) at masked positions can never reach the loss
value or leak into the gradient through ``0 · inf`` (``masked.masked_input``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from groupwise.masked import masked_input
from groupwise.types import ANCHOR, Rollout


def term_mask(mb: Rollout) -> Tensor:
    """[b,G,T] bool: completion tokens of valid rows (weights are applied later by the objective)."""
    return mb.row_mask.bool()  # [b,G,T]


def loss_tokens(mb: Rollout) -> Tensor:
    """[b,G,T] bool: ``term_mask`` less the tokens a token weight removed (``extras["counted"]``) and the
    ``anchor`` rows, as ``Objective.loss_mask``: the tokens the aggregations count."""
    mask = term_mask(mb)  # [b,G,T]
    if ANCHOR in mb.row_flags:
        mask = mask & ~mb.flag(ANCHOR)[..., None]  # [b,G,T]
    return mask & mb.extras["counted"].bool() if "counted" in mb.extras else mask


def group_members(mask: Tensor, rewards: Tensor | None) -> Tensor:
    """[b,G] bool: the rows a group-level term compares — rows with a loss token and, when the batch
    is scored, a finite reward (a row without a verdict is in no comparison)."""
    members = mask.any(-1)  # [b,G]
    if rewards is not None:
        members = members & torch.isfinite(rewards)  # [b,G]
    return members


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


def ratio_and_adv(mb: Rollout, out: dict[str, Tensor], who: str) -> tuple[Tensor, Tensor]:
    """([b,G,T] token ratio exp(logp − logp_old), [b,G,T] token advantages), both 0-safe outside the mask."""
    mask = term_mask(mb)  # [b,G,T]
    logp = masked_input(out["logp"], mask)  # [b,G,T]
    logp_old = masked_input(required(mb, "logp_old", who), mask)  # [b,G,T]
    ratio = torch.exp(logp - logp_old)  # [b,G,T]
    return ratio, token_advantages(mb, mask, who)


def clipped_surrogate(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None = None
) -> Tensor:
    """Per-token PPO loss −min(ratio·adv, clip(ratio)·adv), optionally dual-clipped for adv < 0."""
    surr = ratio * adv  # [b,G,T]
    surr_clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv  # [b,G,T]
    loss = -torch.minimum(surr, surr_clipped)  # [b,G,T]
    if dual_clip is not None:
        cap = -dual_clip * adv  # [b,G,T]
        loss = torch.where((adv < 0) & (loss > cap), cap, loss)  # [b,G,T]
    return loss


def clip_stats(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None = None
) -> dict[str, Tensor]:
    """Per-token clip indicators (float 0/1) and the ratio, for logging."""
    ratio = ratio.detach()  # [b,G,T]
    stats = {
        "clip_low": ((ratio < 1.0 - eps_low) & (adv < 0)).float(),  # [b,G,T]
        "clip_high": ((ratio > 1.0 + eps_high) & (adv > 0)).float(),  # [b,G,T]
        "ratio": ratio,  # [b,G,T]
    }
    if dual_clip is not None:
        stats["clip_dual"] = ((ratio > dual_clip) & (adv < 0)).float()  # [b,G,T]
    return stats


def check_clip(who: str, eps_low: float, eps_high: float, no_lower_clip: bool = False) -> None:
    """``no_lower_clip``: the term clamps the ratio itself, so eps_low = 1 (lower bound 0: no lower clip)
    is valid; the other clipping terms (sequence-level or log-space bounds) keep eps_low < 1."""
    if not (0.0 <= eps_low <= 1.0 if no_lower_clip else 0.0 <= eps_low < 1.0):
        raise ValueError(f"{who}: eps_low must be in [0, {'1]' if no_lower_clip else '1)'}, got {eps_low}")
    if eps_high < 0.0:
        raise ValueError(f"{who}: eps_high must be >= 0, got {eps_high}")


def row_advantages(mb: Rollout, mask: Tensor, who: str) -> Tensor:
    """[b,G] float32 advantages per row: a sequence advantage as is, a token-level one averaged over ``mask``."""
    adv = token_advantages(mb, mask, who)  # [b,G,T], 0 outside mask
    if mb.advantages.dim() == 2:
        return torch.where(mask.any(-1), mb.advantages.float(), torch.zeros(()))  # [b,G]
    return adv.sum(-1) / mask.sum(-1).clamp(min=1).to(adv.dtype)  # [b,G]


def seq_ref_log_ratio(mb: Rollout, out: dict[str, Tensor], who: str) -> Tensor:
    """[b,G] float32 Σ_t mask·(logp − logp_ref): the row's sequence log-ratio to the reference (0 for an empty row)."""
    mask = term_mask(mb)  # [b,G,T]
    logp = masked_input(out["logp"], mask)  # [b,G,T]
    logp_ref = masked_input(required(mb, "logp_ref", who), mask)  # [b,G,T]
    return (logp - logp_ref).sum(-1)  # [b,G]


def scored_rows(mb: Rollout, scores: Tensor) -> Tensor:
    """[b,G] bool: rows with at least one loss token (``loss_tokens``) and a finite score."""
    return loss_tokens(mb).any(-1) & torch.isfinite(scores)  # [b,G]
