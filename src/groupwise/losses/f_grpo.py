"""F-GRPO's two-phase sequence-level objective: one clipped sequence ratio per phase of a completion.

"F-GRPO: Factorized Group-Relative Policy Optimization" (generate-then-rank), Surana, Mundada, Wu,
Li, Jiao, Jin, Zhou, Yu, Sinha, Han, Shang, McAuley, 2026. https://arxiv.org/abs/2605.12995
(spec: specs/24). The phase advantages come from ``advantages/f_grpo.py``.

**Change vs GRPO**

- The policy factorises as π(y) = π_gen(seg1) · π_rank(seg2 | seg1); each phase gets its own
  length-normalised sequence ratio (a geometric mean over its tokens, as GSPO does for a whole
  sequence) and its own clipped surrogate, and a row's loss is the sum of the two.

**Math** (``phase`` [b,G,T]: 0 generation, 1 ranking; ``m_p`` = loss tokens of phase p; ``adv`` the
token advantages, constant within a phase when they come from ``f_grpo``)::

    rho_p  = exp( mean_{t ∈ m_p} (logp − logp_old) )                      # [b,G]
    A_p    = mean_{t ∈ m_p} adv                                            # [b,G]
    loss   = − Σ_p min(rho_p · A_p, clip(rho_p, 1 − eps_low, 1 + eps_high) · A_p)   # [b,G] a row loss
    (level="token": loss_t = −min(ratio_t · adv_t, clip(ratio_t) · adv_t), GRPO's surrogate per token)

**Defaults**

- ``level = "sequence"`` [ABSTRACT] "two-phase sequence-level objective" (its form [INFERRED]);
  ``"token"`` is the spec's ``ratio_level='token'`` option (= ``ppo_clip`` on the phase advantages).
- ``eps_low = eps_high = 0.2`` [INFERRED] PPO's ε (no value is published).
- ``cand_tags = ["[", "]"]`` [INFERRED] as ``advantages/f_grpo.py`` (set both alike).
- λ_rank lives in the advantage (``rank_coef``), so both levels see it [INFERRED].

**Notes**

1. The phase map is computed once per step on the whole batch (``prepare``, from the policy's
   vocabulary) and travels with the rows as the token extra ``f_grpo.phase``. A batch without it
   (a bare unit call) is one phase per row: GSPO's sequence ratio with PPO's ε.
2. Under ``seq_mean_token_mean`` (GRPO's) the row values average over rows: exactly the spec's
   mean over sequences of the two-phase sum. A phase without loss tokens contributes 0.
3. On-policy rho_p = 1 and ∇rho_p = mean_{t∈m_p} ∇logp_t: with one phase this is the REINFORCE
   gradient under every aggregation (a row value counts once per loss token of its row).
4. Token weights (``token_weights``, objective.py): per token at ``level = "token"``; none at
   ``level = "sequence"``, where each phase has one clipped ratio and no source defines how a token
   weight enters it, so a configuration with a token weight is refused at build.
5. ``stats``: ``ratio_gen``/``ratio_rank`` (rho_p, 1 for an empty phase) and ``clip_low``/``clip_high``
   (some phase clipped), per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.advantages.f_grpo import phase_ids
from groupwise.errors import ConfigError
from groupwise.losses._common import check_clip, clip_stats, clipped_surrogate, required, term_mask, token_advantages
from groupwise.masked import masked_input, masked_mean
from groupwise.registry import register
from groupwise.textspans import check_tags
from groupwise.types import Rollout, StepInfo

PHASE_KEY = "f_grpo.phase"


def fgrpo_loss(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    phase: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[Tensor, Tensor, Tensor]:
    """[b,G,T] inputs -> (row loss [b,G], rho [b,G,2], A [b,G,2]) of the two-phase objective."""
    rhos, advs, loss = [], [], torch.zeros(mask.shape[:2], dtype=torch.float32)  # [b,G]
    for p in (0, 1):
        m = mask & (phase == p)  # [b,G,T]
        has = m.any(-1)  # [b,G]
        rho = torch.exp(masked_mean(logp - logp_old, m, dim=-1))  # [b,G] 1 for an empty phase
        A = masked_mean(adv, m, dim=-1)  # [b,G]
        term = -torch.minimum(rho * A, rho.clamp(1.0 - eps_low, 1.0 + eps_high) * A)  # [b,G]
        loss = loss + torch.where(has, term, torch.zeros((), dtype=term.dtype))  # [b,G]
        rhos.append(rho)
        advs.append(A)
    return loss, torch.stack(rhos, -1), torch.stack(advs, -1)


@register("objective", "f_grpo")
@dataclass
class FGRPOLoss:
    """One clipped length-normalised sequence ratio per phase (generation, ranking), summed per row (F-GRPO, Surana et
    al. 2026)."""

    level: str = "sequence"  # "sequence" | "token"
    eps_low: float = 0.2
    eps_high: float = 0.2
    cand_tags: list = field(default_factory=lambda: ["[", "]"])
    coef: float = 1.0
    agg: str | None = None
    _token_text: Any = field(default=None, init=False, repr=False)

    needs = ()
    token_weights_reason = (
        "at level = 'sequence' each phase of a row has one clipped ratio, with no weighted form "
        "(level = 'token' takes them)"
    )

    @property
    def token_weights(self) -> str:
        return "token" if self.level == "token" else "none"  # Note 4

    def __post_init__(self) -> None:
        check_clip("f_grpo", self.eps_low, self.eps_high)
        if self.level not in ("sequence", "token"):
            raise ConfigError(f"objective f_grpo: level must be 'sequence' or 'token', got {self.level!r}")
        check_tags(self.cand_tags, "objective f_grpo: cand_tags", need_open=True)

    def use_vocabulary(self, token_text: list[str]) -> None:
        self._token_text = list(token_text)

    def prepare(self, batch: Rollout, info: StepInfo) -> None:
        """Once per step on the whole batch: the phase map (Note 1)."""
        if self._token_text is None:
            raise ValueError(
                "objective f_grpo has no vocabulary: it needs a text policy (the trainer calls use_vocabulary at build)"
            )
        B, G, T = batch.shape
        phase = phase_ids(
            batch.actions.reshape(B * G, T), batch.mask.reshape(B * G, T), self._token_text, self.cand_tags
        )  # [N,T]
        batch.extras.pop(PHASE_KEY, None)
        batch.set_extra(PHASE_KEY, phase.reshape(B, G, T), "token")

    def _inputs(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, ...]:
        mask = term_mask(mb)  # [b,G,T]
        if "counted" in mb.extras:
            mask = mask & mb.extras["counted"]  # [b,G,T]
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        logp_old = masked_input(required(mb, "logp_old", "f_grpo"), mask)  # [b,G,T]
        phase = mb.extras[PHASE_KEY] if PHASE_KEY in mb.extras else torch.zeros_like(mask, dtype=torch.long)  # [b,G,T]
        return logp, logp_old, token_advantages(mb, mask, "f_grpo"), phase, mask

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        logp, logp_old, adv, phase, mask = self._inputs(mb, out)  # [b,G,T] x4, [b,G,T] bool
        if self.level == "token":
            return clipped_surrogate(torch.exp(logp - logp_old), adv, self.eps_low, self.eps_high)  # [b,G,T]
        return fgrpo_loss(logp, logp_old, adv, phase, mask, self.eps_low, self.eps_high)[0]  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        logp, logp_old, adv, phase, mask = self._inputs(mb, {"logp": out["logp"].detach()})
        if self.level == "token":
            return clip_stats(torch.exp(logp - logp_old), adv, self.eps_low, self.eps_high)
        _, rho, A = fgrpo_loss(logp, logp_old, adv, phase, mask, self.eps_low, self.eps_high)  # [b,G,2] x2
        return {
            "ratio_gen": rho[..., 0],
            "ratio_rank": rho[..., 1],
            "clip_low": ((rho < 1.0 - self.eps_low) & (A < 0)).any(-1).float(),  # [b,G]
            "clip_high": ((rho > 1.0 + self.eps_high) & (A > 0)).any(-1).float(),
        }  # [b,G]
