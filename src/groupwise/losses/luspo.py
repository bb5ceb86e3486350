"""LUSPO: GSPO's clipped sequence-ratio loss, scaled by the sequence's length.

"Length-Unbiased Sequence Policy Optimization: Revealing and Controlling Response Length Variation
in RLVR", Fanfan Liu, Youyang Yin, Peng Shi, Siqi Yang, Zhixiong Zeng, Haibo Qiu, 2026.
https://arxiv.org/abs/2602.05261 (authors' code: github.com/murphy4122/LUSPO, not read here).
Reference implementation matched: TRL 1.16.0, ``trl/trainer/grpo_trainer.py``,
``GRPOTrainer._compute_loss`` with ``loss_type="luspo"``. Two-sided clip: INTELLECT-2, Prime
Intellect Team, 2025, https://arxiv.org/abs/2505.07291 (TRL's ``delta``).

**Change vs GRPO**

- The ratio is GSPO's length-normalised sequence ratio, clipped per sequence (``level =
  "sequence"``, which TRL asks for with a warning otherwise).
- Each sequence's loss is the *sum* of its tokens' losses, i.e. |y| times GSPO's, removing GSPO's
  bias towards short responses: every token of the batch weighs the same, whatever its row's length.

**Math** (``mask`` = completion tokens of valid rows, ``|y|`` their count per row)::

    log_s = Σ_t mask·(logp - logp_old) / |y|                  # [b,G]  (level = "sequence")
    ratio = exp(log_s)  broadcast to tokens                   # or exp(logp - logp_old) (level = "token")
    r_hi  = min(ratio, delta)                                 (delta = None: r_hi = ratio)
    l_t   = -min(r_hi * adv_t, clip(ratio, 1 - eps_low, 1 + eps_high) * adv_t)     # [b,G,T]
    loss  = Σ_rows Σ_t mask·w_t·l_t / #rows     (agg "seq_mean_token_sum"; w_t the token weights)

TRL's ``(per_token_loss * mask).sum(-1).mean()``, where ``per_token_loss`` has been multiplied by the
vLLM importance-sampling ratio, the off-policy mask and the entropy mask: our token weights.

**Defaults**

- ``level = "sequence"`` [CODE] TRL warns that ``luspo`` "should be set to 'sequence' to mirror the
  paper's setup" [PAPER]. ``level = "token"`` reproduces TRL's ``luspo`` under its default
  ``importance_sampling_level="token"``.
- ``eps_low = 3e-4``, ``eps_high = 4e-4`` [INFERRED] GSPO's clip ranges, which LUSPO (a modification
  of GSPO) is assumed to keep; TRL's generic default is ``epsilon = 0.2`` for every loss type [CODE].
- ``delta = None`` (off) [CODE] TRL ``delta=None``; a number δ caps the unclipped branch of the min
  at δ (INTELLECT-2's two-sided clip; TRL recommends δ > 1 + ε), bounding the loss of a
  negative-advantage row whose ratio exploded.
- ``agg = "seq_mean_token_sum"`` [CODE] set on the term: the length scaling is LUSPO's only under
  this aggregation (TRL's sum over tokens, mean over rows).

**Notes**

1. Per-token term ([b,G,T]): each token carries its ratio's clipped surrogate; the aggregation
   ``seq_mean_token_sum`` sums a row's tokens, which gives the length factor. Under another
   aggregation the term is another loss (``seq_mean_token_mean``: GSPO's with the ratio's full
   gradient; ``token_mean``: a token mean). Token weights multiply each token's value
   (``token_weights = "token"``, objective.py): TRL's IS ratio, off-policy and entropy masks.
2. ``on_policy_reinforce = False``: on-policy the gradient is −adv·Σ_t ∇logp_t per row (a sum,
   not a mean over tokens), i.e. REINFORCE with the sum-over-tokens normaliser — by design, not
   the token-mean REINFORCE gradient of the other ratio terms.
3. With ``level = "sequence"`` the ratio has full autograd (TRL's form, not GSPO-token): the
   gradient of row i is −adv·s_i·(1/|y|)·Σ_t w_t·Σ_t ∇logp_t when unclipped, 0 when the sequence is
   clipped (w_t the token weights, 1 without). A ratio exactly on 1 ± eps keeps its gradient
   (closed interval, as ``ppo_clip``); a ratio above δ gets none from the δ branch.
4. ``delta`` is TRL's: it clamps the ratio of the unclipped branch *before* the min, for either sign
   of the advantage. For δ > 1 + eps_high it binds only where adv < 0 and ratio > δ (``ppo_clip``'s
   ``dual_clip`` with c = δ); δ must be > 1 (on-policy, ratio = 1 must stay unclipped).
5. TRL divides by every row of the micro-batch, including rows with no tokens; the aggregation
   counts rows with ≥ 1 loss token (aggregation.py note 3): equal when every row has a token.
6. Statistics (TRL's definitions, per row at sequence level, per token at token level):
   ``clip_low`` = ratio < 1 − eps_low and adv < 0, ``clip_high`` = ratio > 1 + eps_high and adv > 0,
   ``ratio``; with ``delta``, ``clip_delta`` = ratio > δ and adv < 0.
7. ``logp - logp_old`` is zeroed outside the mask first (padding never reaches the loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import check_clip, required, term_mask, token_advantages
from groupwise.masked import masked_input, masked_mean
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

LEVELS = ("sequence", "token")


def two_sided_surrogate(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, delta: float | None = None
) -> Tensor:
    """[b,G,T] TRL's per-token loss −min(min(ratio, δ)·adv, clip(ratio, 1 − eps_low, 1 + eps_high)·adv)."""
    capped = ratio if delta is None else ratio.clamp(max=delta)  # [b,G,T] the unclipped branch, capped at δ
    return -torch.minimum(capped * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)  # [b,G,T]


@register("objective", "luspo")
@dataclass
class LUSPO:
    """GSPO clipped sequence-ratio loss summed over tokens (LUSPO, Liu et al. 2026; TRL loss_type="luspo")."""

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    level: str = "sequence"
    delta: float | None = None
    coef: float = 1.0
    agg: str | None = "seq_mean_token_sum"

    needs = ()
    on_policy_reinforce = False  # Note 2: the on-policy gradient sums, not averages, over tokens

    def __post_init__(self) -> None:
        check_clip("luspo", self.eps_low, self.eps_high)
        if self.level not in LEVELS:
            raise ValueError(f"luspo: level must be one of {LEVELS}, got {self.level!r}")
        if self.delta is not None and not self.delta > 1.0:
            raise ValueError(f"luspo: delta must be > 1 (TRL recommends > 1 + eps_high) or None, got {self.delta}")

    def _ratio_adv(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        mask = term_mask(mb)  # [b,G,T]
        d = masked_input(out["logp"], mask) - masked_input(required(mb, "logp_old", "luspo"), mask)  # [b,G,T]
        adv = token_advantages(mb, mask, "luspo")  # [b,G,T]
        if self.level == "sequence":
            ratio = torch.exp(masked_mean(d, mask, dim=-1))[..., None].expand_as(d)  # [b,G,T]
        else:
            ratio = torch.exp(d)  # [b,G,T]
        return ratio, adv, mask

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        ratio, adv, mask = self._ratio_adv(mb, out)  # [b,G,T] x3
        loss_t = two_sided_surrogate(ratio, adv, self.eps_low, self.eps_high, self.delta)  # [b,G,T]
        return torch.where(mask, loss_t, torch.zeros((), dtype=loss_t.dtype))  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv, mask = self._ratio_adv(mb, out)  # [b,G,T] x3
        ratio = ratio.detach()  # [b,G,T]
        if self.level == "sequence" and mb.advantages.dim() == 2:  # one value per sequence, as TRL
            ratio = ratio[..., 0]  # [b,G] (the row's ratio is broadcast to every position)
            adv = masked_input(mb.advantages, mask.any(-1))  # [b,G]
        stats = {
            "clip_low": ((ratio < 1.0 - self.eps_low) & (adv < 0)).float(),  # [b,G,T] or [b,G]
            "clip_high": ((ratio > 1.0 + self.eps_high) & (adv > 0)).float(),  # [b,G,T] or [b,G]
            "ratio": ratio,  # [b,G,T] or [b,G]
        }
        if self.delta is not None:
            stats["clip_delta"] = ((ratio > self.delta) & (adv < 0)).float()  # [b,G,T] or [b,G]
        return stats
