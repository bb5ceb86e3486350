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

``eps_low = 1`` removes the lower clip (the ratio's own bound 0: μ-GRPO's relaxed [0, 5]).

**Defaults**

- ``eps_low = eps_high = 0.2`` [PAPER] PPO's ε = 0.2 (Schulman et al. 2017); [CODE] TRL
  ``epsilon=0.2``. DAPO uses ``eps_high = 0.28`` [PAPER].
- ``dual_clip = None`` (off) [CODE] TRL ``delta = None``: TRL's ``delta`` clamps the ratio at δ
  before the min (two-sided GRPO), which for δ > 1 + eps_high is this dual clip with c = δ
  (``tests/test_trl_losses.py``, max difference 0); verl's ``clip_ratio_c`` default is 3.0.

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
5. ``clipped_surrogate`` is the shared primitive (specs/README ``grpo_surrogate``, in
   ``losses/_common.py`` with ``clip_stats``, ``check_clip`` and ``ratio_and_adv``), without the
   aggregation, which the objective applies separately (DESIGN §3).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupwise.losses._common import check_clip, clip_stats, clipped_surrogate, ratio_and_adv  # noqa: F401  (shared primitives, re-exported)
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


@register("objective", "ppo_clip")
@dataclass
class PPOClip:
    """PPO clipped surrogate with asymmetric clip (clip-higher) and optional dual clip (GRPO/PPO, Schulman et al.
    2017)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    coef: float = 1.0
    agg: str | None = None

    needs = ()

    def __post_init__(self) -> None:
        # eps_low = 1: μ-GRPO's relaxed [0, 1 + eps_high]
        check_clip("ppo_clip", self.eps_low, self.eps_high, no_lower_clip=True)
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"ppo_clip: dual_clip must be > 1 (or None), got {self.dual_clip}")

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        ratio, adv = ratio_and_adv(mb, out, "ppo_clip")  # [b,G,T], [b,G,T]
        return clipped_surrogate(ratio, adv, self.eps_low, self.eps_high, self.dual_clip)  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv = ratio_and_adv(mb, out, "ppo_clip")  # [b,G,T], [b,G,T]
        return clip_stats(ratio, adv, self.eps_low, self.eps_high, self.dual_clip)
