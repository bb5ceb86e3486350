"""LUSPO: GSPO's clipped sequence-ratio loss, scaled by the sequence's length.

"Length-Unbiased Sequence Policy Optimization: Revealing and Controlling Response Length Variation
in RLVR", Fanfan Liu, Youyang Yin, Peng Shi, Siqi Yang, Zhixiong Zeng, Haibo Qiu, 2026.
https://arxiv.org/abs/2602.05261 (authors' code: github.com/murphy4122/LUSPO, not read here).
Reference implementation matched: TRL 1.16.0, ``trl/trainer/grpo_trainer.py``,
``GRPOTrainer._compute_loss`` with ``loss_type="luspo"``.

**Change vs GRPO**

- The ratio is GSPO's length-normalised sequence ratio, clipped per sequence (``level =
  "sequence"``, which TRL asks for with a warning otherwise).
- Each sequence's loss is multiplied by its length |y_i|, removing GSPO's bias towards short
  responses: every token of the batch weighs the same, whatever its row's length.

**Math** (``mask`` = completion tokens of valid rows, ``|y|`` their count per row)::

    log_s = Σ_t mask·(logp - logp_old) / |y|                  # [b,G]  (level = "sequence")
    ratio = exp(log_s)  broadcast to tokens                   # or exp(logp - logp_old) (level = "token")
    l_t   = -min(ratio * adv_t, clip(ratio, 1 - eps_low, 1 + eps_high) * adv_t)      # [b,G,T]
    loss  = Σ_t mask·l_t  (= |y|·l for a sequence advantage)                      # [b,G]

With ``agg = "seq_mean_token_mean"`` the batch loss is Σ_i |y_i|·l_i / #rows — TRL's
``(per_token_loss * mask).sum(-1).mean()``.

**Defaults**

- ``level = "sequence"`` [CODE] TRL warns that ``luspo`` "should be set to 'sequence' to mirror the
  paper's setup" [PAPER]. ``level = "token"`` reproduces TRL's ``luspo`` under its default
  ``importance_sampling_level="token"``.
- ``eps_low = 3e-4``, ``eps_high = 4e-4`` [INFERRED] GSPO's clip ranges, which LUSPO (a modification
  of GSPO) is assumed to keep; TRL's generic default is ``epsilon = 0.2`` for every loss type [CODE].
- ``agg = "seq_mean_token_mean"`` [CODE] set on the term: the length scaling is only LUSPO's under
  this aggregation (TRL's sum over tokens, mean over rows).

**Notes**

1. Row-level term ([b,G]): the length factor lives in the value, so it must not be aggregated by a
   token-weighted mean (``token_mean`` would weight each row by |y|²).
2. ``on_policy_reinforce = False``: on-policy the gradient is −adv·Σ_t ∇logp_t per row (a sum,
   not a mean over tokens), i.e. REINFORCE with the sum-over-tokens normaliser — by design, not
   the token-mean REINFORCE gradient of the other ratio terms.
3. With ``level = "sequence"`` the ratio has full autograd (TRL's form, not GSPO-token): the
   gradient of row i is −adv·s_i·Σ_t ∇logp_t when unclipped, 0 when the sequence is clipped. A
   ratio exactly on 1 ± eps keeps its gradient (closed interval, as ``ppo_clip``).
4. TRL's ``delta`` (INTELLECT-2 two-sided clip) is not provided.
5. TRL divides by every row of the micro-batch, including rows with no tokens; the aggregation
   counts rows with ≥ 1 loss token (aggregation.py note 3): equal when every row has a token.
6. Statistics (TRL's definitions, per row at sequence level, per token at token level):
   ``clip_low`` = ratio < 1 − eps_low and adv < 0, ``clip_high`` = ratio > 1 + eps_high and adv > 0,
   ``ratio``.
7. ``logp - logp_old`` is zeroed outside the mask first (padding never reaches the loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import check_clip, clipped_surrogate, masked_input, required, term_mask, token_advantages
from groupwise.masked import masked_mean, masked_sum
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

LEVELS = ("sequence", "token")


@register("objective", "luspo")
@dataclass
class LUSPO:
    """GSPO clipped sequence-ratio loss times sequence length (LUSPO, Liu et al. 2026; TRL loss_type="luspo")."""

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    level: str = "sequence"
    coef: float = 1.0
    agg: str | None = "seq_mean_token_mean"

    needs = ()
    on_policy_reinforce = False  # Note 2: the on-policy gradient sums, not averages, over tokens

    def __post_init__(self) -> None:
        check_clip("luspo", self.eps_low, self.eps_high)
        if self.level not in LEVELS:
            raise ValueError(f"luspo: level must be one of {LEVELS}, got {self.level!r}")

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
        loss_t = clipped_surrogate(ratio, adv, self.eps_low, self.eps_high)  # [b,G,T]
        return masked_sum(loss_t, mask, dim=-1)  # [b,G]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv, mask = self._ratio_adv(mb, out)  # [b,G,T] x3
        ratio = ratio.detach()  # [b,G,T]
        if self.level == "sequence" and mb.advantages.dim() == 2:  # one value per sequence, as TRL
            ratio = ratio[..., 0]  # [b,G] (the row's ratio is broadcast to every position)
            adv = masked_input(mb.advantages, mask.any(-1))  # [b,G]
        return {
            "clip_low": ((ratio < 1.0 - self.eps_low) & (adv < 0)).float(),  # [b,G,T] or [b,G]
            "clip_high": ((ratio > 1.0 + self.eps_high) & (adv > 0)).float(),  # [b,G,T] or [b,G]
            "ratio": ratio,  # [b,G,T] or [b,G]
        }
