"""DPPO: a trust region on the policy divergence (binary TV or binary KL) instead of the ratio clip.

"Rethinking the Trust Region in LLM Reinforcement Learning", Penghui Qi, Xiangxin Zhou, Zichen Liu,
Tianyu Pang, Chao Du, Min Lin, Wee Sun Lee, 2026. https://arxiv.org/abs/2602.04879 — reference
implementations: verl ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_dppo_tv`` /
``compute_policy_loss_dppo_kl`` (verl PR 5397), and the authors' sail-sg/Stable-RL
``core_algos.py`` ``compute_policy_loss_with_mask`` / ``_compute_token_mask_for_policy_loss``.

**Change vs GRPO**: PPO removes a token's gradient when its probability *ratio* leaves
[1 − ε, 1 + ε], a noisy one-sample proxy of the divergence that over-penalises rare tokens and
under-constrains likely ones. DPPO removes it when the Binary approximation of the divergence
between the current and the anchor policy — the two-outcome distributions {token, not token} —
leaves the trust region in the direction the advantage pushes. The surviving tokens get the
truncated-IS policy gradient ``sg[min(ratio, C)]·A·∇logp`` (no ratio clip).

**Math** (per token; ``q`` = anchor probability of the sampled token, ``p`` = current one)::

    d      = clamp(logp - logp_anchor, -20, 20);  ratio = exp(d);  w = sg[min(ratio, clip_ratio_c)]
    p, q   = exp(logp), exp(logp_anchor)
    dppo_tv:  valid = (p - q <= delta_high)                       where adv > 0
                      (p - q >= -delta_low)                       where adv <= 0
    dppo_kl:  kl    = q*(log q - log p) + (1-q)*log((1-q+1e-8)/(1-p+1e-8))
              valid = (kl <= delta_high) | (p <= q)               where adv > 0
                      (kl <= delta_low)  | (p >= q)               where adv <= 0
    loss   = -adv * w * sg[valid] * logp

**Defaults**

- ``dppo_tv``: ``delta_low = delta_high = 0.15`` [CODE] verl ``examples/dppo_trainer/run_qwen30b_dppo.sh``
  (``CLIP_DEFAULT=0.15``; verl reads the thresholds from ``clip_ratio_low/high``).
- ``dppo_kl``: ``delta_low = delta_high = 0.05`` [CODE] same script (``CLIP_DEFAULT=0.05``).
- ``clip_ratio_c = 3.0`` [CODE] verl's configured value: ``clip_ratio_c: 3.0`` in
  ``verl/trainer/config/actor/actor.yaml`` (``ActorConfig.clip_ratio_c = 3.0``,
  ``verl/workers/config/actor.py``), which every verl actor config carries, so the loss's
  ``config.get("clip_ratio_c", 20.0)`` fallback is never reached. Stable-RL uses 10.0.
- ``anchor = "old"`` [CODE] verl compares with ``old_log_prob``; ``"sampler"`` [CODE] Stable-RL's
  ``dppo_binary_tv`` / ``dppo_binary_kl`` anchor to the rollout engine's log-probs
  (``rollout.logp_sampler``), the behaviour policy the paper's trust region is defined on.

**Notes**

1. Only the gradient is meaningful; the loss value is −A·w·logp (a REINFORCE surrogate).
2. On-policy (``logp = logp_old``): p = q, so every token is valid and w = 1 — exactly the REINFORCE
   gradient (checked in ``tests/test_contracts.py``).
3. ``adv = 0`` takes the ``adv <= 0`` branch (verl's ``torch.where(advantages > 0, ...)``); its loss is 0.
4. Statistics: ``tr_masked`` (share of tokens outside the trust region, verl's ``pg_clipfrac``) and
   ``is_truncated`` (valid tokens with ratio > C, verl's ``pg_clipfrac_lower``).
5. Stable-RL clamps ``d`` only from above (≤ 20); verl clamps both sides. They differ only for
   ratios below e^−20 (w ≈ 0 either way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import required, term_mask, token_advantages
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

ANCHORS = {"old": "logp_old", "sampler": "logp_sampler"}


class _DPPO:
    delta_low: float
    delta_high: float
    clip_ratio_c: float
    anchor: str

    def __post_init__(self) -> None:
        name = self.registry_name
        if self.anchor not in ANCHORS:
            raise ValueError(f"{name}: anchor must be one of {', '.join(ANCHORS)}, got {self.anchor!r}")
        if self.delta_low < 0 or self.delta_high < 0:
            raise ValueError(f"{name}: delta_low and delta_high must be >= 0, got {self.delta_low}, {self.delta_high}")
        if not self.clip_ratio_c > 0:
            raise ValueError(f"{name}: clip_ratio_c must be > 0, got {self.clip_ratio_c}")

    @property
    def reads_sampler_logp(self) -> bool:  # anchor = "sampler" compares with logp_sampler (build.check_policy_fit)
        return self.anchor == "sampler"

    def _valid(self, p: Tensor, q: Tensor, logp: Tensor, logq: Tensor, pos: Tensor) -> Tensor: ...

    def _parts(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, ...]:
        mask = term_mask(mb)  # [b,G,T]
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        logq = masked_input(required(mb, ANCHORS[self.anchor], self.registry_name), mask)  # [b,G,T]
        adv = token_advantages(mb, mask, self.registry_name)  # [b,G,T]
        ratio = torch.exp((logp - logq).clamp(-20.0, 20.0)).detach()  # [b,G,T]
        w = ratio.clamp(max=self.clip_ratio_c)  # [b,G,T]
        valid = self._valid(logp.exp().detach(), logq.exp(), logp.detach(), logq, adv > 0)  # [b,G,T] bool
        return logp, adv, w, valid, ratio

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        logp, adv, w, valid, _ = self._parts(mb, out)
        return -adv * w * valid.float() * logp  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        _, _, _, valid, ratio = self._parts(mb, out)
        return {"tr_masked": (~valid).float(), "is_truncated": ((ratio > self.clip_ratio_c) & valid).float()}  # [b,G,T]


@register("objective", "dppo_tv")
@dataclass
class DPPOBinaryTV(_DPPO):
    """Truncated-IS policy gradient inside a binary total-variation trust region (DPPO-Binary-TV, Qi et al. 2026)."""

    delta_low: float = 0.15
    delta_high: float = 0.15
    clip_ratio_c: float = 3.0
    anchor: str = "old"
    coef: float = 1.0
    agg: str | None = None

    needs = ()

    def _valid(self, p, q, logp, logq, pos) -> Tensor:
        return torch.where(pos, p - q <= self.delta_high, p - q >= -self.delta_low)  # [b,G,T]


@register("objective", "dppo_kl")
@dataclass
class DPPOBinaryKL(_DPPO):
    """Truncated-IS policy gradient inside a binary KL trust region (DPPO-Binary-KL, Qi et al. 2026)."""

    delta_low: float = 0.05
    delta_high: float = 0.05
    clip_ratio_c: float = 3.0
    anchor: str = "old"
    coef: float = 1.0
    agg: str | None = None

    needs = ()

    def _valid(self, p, q, logp, logq, pos) -> Tensor:
        kl = q * (logq - logp) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))  # [b,G,T]
        return torch.where(pos, (kl <= self.delta_high) | (p <= q), (kl <= self.delta_low) | (p >= q))  # [b,G,T]
