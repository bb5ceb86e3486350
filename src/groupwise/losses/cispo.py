"""CISPO: clip the importance-sampling weight (stop-gradient), never the token's gradient.

"MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", MiniMax (Aili Chen,
Aonian Li, et al.), 2025. https://arxiv.org/abs/2506.13585 — §3.1 "Efficient RL Scaling with CISPO".
The ``eps_max`` parameterisation is ScaleRL's: "The Art of Scaling Reinforcement Learning Compute
for LLMs", Devvrit Khatri et al., 2025, https://arxiv.org/abs/2510.13786.
Reference implementation matched: TRL 1.16.0, ``trl/trainer/grpo_trainer.py``,
``GRPOTrainer._compute_loss`` with ``loss_type="cispo"`` (``importance_sampling_level="token"``, and
``"sequence"`` as ``level = "sequence"``).

**Change vs GRPO**

- No PPO min/clip: every token keeps its REINFORCE gradient −adv·∇logp, scaled by its importance
  weight; only the *weight* is capped (and detached), so off-policy tokens are damped, never dropped.
- Token-level normalisation (1/Σ|o_i|) in the paper and in TRL.

**Math** (per token; ``adv`` [b,G] is broadcast to [b,G,T])::

    ratio = exp(logp - logp_old)                                   level = "token"
          = exp(Σ_t mask·(logp - logp_old) / |y|) on every token  level = "sequence"
    w     = sg[clip(ratio, eps_min, eps_max)]       # paper: clip(r, 1 - eps_low_IS, 1 + eps_high_IS)
    loss  = -w * adv * logp

**Defaults**

- ``eps_max = 5.0`` [CODE] TRL ``GRPOConfig.epsilon_high`` help: "when used with
  ``loss_type='cispo'`` this corresponds to ScaleRL's ε_max … the recommended value is 5.0". TRL's
  literal default (``epsilon_high=None`` → ``epsilon=0.2``) caps every ratio at 0.2, i.e. scales even
  the on-policy gradient by 0.2; set ``eps_max=0.2`` to reproduce an untuned TRL run.
- ``eps_min = 0.0`` (no lower bound) [PAPER] MiniMax-M1 sets ε_low^IS large and tunes only the
  upper bound; [CODE] TRL clamps with ``max=`` only.
- ``level = "token"`` [PAPER] [CODE] TRL's default ``importance_sampling_level``; ``"sequence"``
  [CODE] TRL's sequence level (GSPO's length-normalised ratio), an option TRL warns about.
- Aggregation: use ``agg = "token_mean"`` to match TRL (Σ loss·mask / ``num_items_in_batch``) and the
  paper's 1/Σ_i|o_i| [CODE] [PAPER]. ``agg = None`` takes the objective's default.

**Notes**

1. ``eps_max`` is an *absolute* cap on the ratio (ScaleRL/TRL), not 1 + ε: the paper's
   ε_high^IS corresponds to ``eps_max = 1 + ε_high^IS``.
2. The weight is detached: the gradient is −w·adv·∇logp for every token, even where the weight is
   capped (unlike PPO, whose clipped tokens get zero gradient). A ratio exactly on ``eps_max`` gives
   w = eps_max and is not counted as clipped (strict ``>`` as TRL).
3. On-policy, ratio = 1 ≤ eps_max and w = 1: the gradient is exactly REINFORCE's.
4. The loss *value* is −w·adv·logp (TRL's); only its gradient is meaningful as an objective.
5. Statistics: ``clip_high`` = ratio > eps_max and adv > 0 (TRL's ``cispo_clip_ratio``);
   ``clip_low`` = ratio < eps_min and adv < 0 (always 0 with the default); ``ratio``.
6. ``level = "sequence"``: one weight per row, sg[clip(s, eps_min, eps_max)] with s the sequence
   ratio (TRL's ``importance_sampling_level="sequence"``). TRL warns that with a token-sum
   aggregation this weighs each row by its length. Statistics are then per row (per token with
   token-level advantages), as TRL's ``cispo_clip_ratio``.
7. ``logp - logp_old`` and ``logp`` are zeroed outside the mask first (garbage padding never
   reaches the loss or the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import ratio_and_adv, required, term_mask, token_advantages
from groupwise.masked import masked_input, masked_mean
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("objective", "cispo")
@dataclass
class CISPO:
    """REINFORCE weighted by a capped, stop-gradient importance ratio (CISPO, MiniMax-M1 2025)."""

    eps_max: float = 5.0
    eps_min: float = 0.0
    level: str = "token"  # "token" | "sequence"
    coef: float = 1.0
    agg: str | None = None

    needs = ()

    def __post_init__(self) -> None:
        if not self.eps_max > 0.0:
            raise ValueError(f"cispo: eps_max must be > 0, got {self.eps_max}")
        if not 0.0 <= self.eps_min < self.eps_max:
            raise ValueError(f"cispo: eps_min must be in [0, eps_max), got {self.eps_min}")
        if self.level not in ("token", "sequence"):
            raise ValueError(f"cispo: level must be 'token' or 'sequence', got {self.level!r}")

    def _ratio_adv(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        if self.level == "token":
            return ratio_and_adv(mb, out, "cispo")  # [b,G,T], [b,G,T]
        mask = term_mask(mb)  # [b,G,T]
        d = masked_input(out["logp"], mask) - masked_input(required(mb, "logp_old", "cispo"), mask)  # [b,G,T]
        ratio = torch.exp(masked_mean(d, mask, dim=-1))[..., None].expand_as(d)  # [b,G,T] the row's sequence ratio
        return ratio, token_advantages(mb, mask, "cispo")  # [b,G,T], [b,G,T]

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        ratio, adv = self._ratio_adv(mb, out)  # [b,G,T], [b,G,T]
        logp = masked_input(out["logp"], term_mask(mb))  # [b,G,T]
        w = ratio.clamp(self.eps_min, self.eps_max).detach()  # [b,G,T]
        return -w * adv * logp  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv = self._ratio_adv(mb, out)  # [b,G,T], [b,G,T]
        ratio = ratio.detach()  # [b,G,T]
        if self.level == "sequence" and mb.advantages.dim() == 2:  # one value per sequence, as TRL logs it
            ratio = ratio[..., 0]  # [b,G] (the row's ratio is broadcast to every position)
            adv = masked_input(mb.advantages, term_mask(mb).any(-1))  # [b,G]
        return {
            "clip_high": ((ratio > self.eps_max) & (adv > 0)).float(),  # [b,G,T] or [b,G]
            "clip_low": ((ratio < self.eps_min) & (adv < 0)).float(),  # [b,G,T] or [b,G]
            "ratio": ratio,  # [b,G,T] or [b,G]
        }
