"""PPO clipped surrogate (GRPO's policy loss), with asymmetric clip and optional dual clip.

"Proximal Policy Optimization Algorithms", John Schulman, Filip Wolski, Prafulla Dhariwal,
Alec Radford, Oleg Klimov, 2017. https://arxiv.org/abs/1707.06347 — used by GRPO (Shao et al.
2024, https://arxiv.org/abs/2402.03300). Clip-higher: DAPO, Yu et al. 2025,
https://arxiv.org/abs/2503.14476. Dual clip: "Mastering Complex Control in MOBA Games with Deep
Reinforcement Learning", Deheng Ye et al., 2020, https://arxiv.org/abs/1912.09729.

**Change vs GRPO**: none by default (this is GRPO's surrogate). ``eps_high > eps_low`` gives DAPO's
clip-higher; ``dual_clip = c`` bounds the loss of negative-advantage tokens whose ratio exploded.

**Math** (per token; ``adv`` [b,G] is broadcast to [b,G,T])::

    ratio = exp(logp - logp_old)
    loss  = -min(ratio * adv, clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    loss  = min(loss, -dual_clip * adv)            where adv < 0   (dual clip, c > 1)

**Defaults**

- ``eps_low = eps_high = 0.2`` [PAPER] PPO's ε = 0.2 (Schulman et al. 2017); [CODE] TRL
  ``epsilon=0.2``. DAPO uses ``eps_high = 0.28`` [PAPER].
- ``dual_clip = None`` (off) [CODE] TRL has no dual clip; verl's ``clip_ratio_c`` default is 3.0.

**Notes**

1. Statistics, as TRL defines them: ``clip_low`` = adv < 0 and ratio < 1 − eps_low, ``clip_high``
   = adv > 0 and ratio > 1 + eps_high — the tokens whose gradient the clip removes. ``clip_dual``
   (only when dual clip is on) = adv < 0 and ratio > dual_clip. ``ratio`` is the ratio itself.
2. The clip interval is closed: a ratio exactly on 1 ± eps still receives the full gradient
   (``torch.clamp`` passes gradient at its bounds, and both branches of the min agree there), and is
   not counted as clipped. Likewise the dual-clip cap applies only strictly above it.
3. On-policy (``logp_old = logp.detach()``) ratio = 1 and ∇ratio = ∇logp, so the gradient is the
   REINFORCE gradient −adv·∇logp (checked for every ratio term in ``tests/test_contracts.py``).
4. ``logp - logp_old`` is zeroed outside the mask before ``exp`` (padding never overflows).
5. ``clipped_surrogate`` is the shared primitive (specs/README ``grpo_surrogate``), without the
   aggregation, which the objective applies separately (DESIGN §3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import masked_input, required, term_mask, token_advantages
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None = None) -> Tensor:
    """Per-token PPO loss −min(ratio·adv, clip(ratio)·adv), optionally dual-clipped for adv < 0."""
    surr = ratio * adv  # [b,G,T]
    surr_clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv  # [b,G,T]
    loss = -torch.minimum(surr, surr_clipped)  # [b,G,T]
    if dual_clip is not None:
        cap = -dual_clip * adv  # [b,G,T]
        loss = torch.where((adv < 0) & (loss > cap), cap, loss)  # [b,G,T]
    return loss


def clip_stats(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None = None) -> dict[str, Tensor]:
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


def check_clip(who: str, eps_low: float, eps_high: float) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"{who}: eps_low must be in [0, 1), got {eps_low}")
    if eps_high < 0.0:
        raise ValueError(f"{who}: eps_high must be >= 0, got {eps_high}")


@register("objective", "ppo_clip")
@dataclass
class PPOClip:
    """PPO clipped surrogate with asymmetric clip (clip-higher) and optional dual clip (GRPO/PPO, Schulman et al. 2017)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    coef: float = 1.0
    agg: str | None = None

    needs = ()

    def __post_init__(self) -> None:
        check_clip("ppo_clip", self.eps_low, self.eps_high)
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"ppo_clip: dual_clip must be > 1 (or None), got {self.dual_clip}")

    def _ratio_adv(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        mask = term_mask(mb)  # [b,G,T]
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        logp_old = masked_input(required(mb, "logp_old", "ppo_clip"), mask)  # [b,G,T]
        ratio = torch.exp(logp - logp_old)  # [b,G,T]
        adv = token_advantages(mb, mask, "ppo_clip")  # [b,G,T]
        return ratio, adv

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        ratio, adv = self._ratio_adv(mb, out)  # [b,G,T], [b,G,T]
        return clipped_surrogate(ratio, adv, self.eps_low, self.eps_high, self.dual_clip)  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv = self._ratio_adv(mb, out)  # [b,G,T], [b,G,T]
        return clip_stats(ratio, adv, self.eps_low, self.eps_high, self.dual_clip)
