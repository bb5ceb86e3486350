"""GSPO: sequence-level importance ratio, clipped per sequence (token form, GSPO-token).

"Group Sequence Policy Optimization", Chujie Zheng, Shixuan Liu, Mingze Li, Xiong-Hui Chen,
Bowen Yu, Chang Gao, Kai Dang, Yuqiong Liu, Rui Men, An Yang, Jingren Zhou, Junyang Lin, 2025.
https://arxiv.org/abs/2507.18071

**Change vs GRPO**

- The importance ratio is the length-normalised sequence likelihood ratio (a geometric mean of
  the token ratios), shared by every token of the row; clipping therefore keeps or drops whole
  sequences.
- Much narrower clip range (3e-4 / 4e-4 instead of 0.2).

**Math** (``mask`` = completion tokens of valid rows, ``|y|`` = their count per row)::

    log_s = Σ_t mask·(logp - logp_old) / |y|                          # [b,G]
    ratio = exp(sg[log_s] + logp - sg[logp])   (GSPO-token: s_{i,t} = sg[s_i]·π_t / sg[π_t])
    loss  = -min(ratio * adv, clip(ratio, 1 - eps_low, 1 + eps_high) * adv)   per token

The value of ``ratio`` is s_i on every token, and ∇ratio_t = s_i ∇logp_t. Averaging the token
losses of a row (aggregation ``seq_mean_token_mean``) gives the gradient
s_i·adv·∇(1/|y| Σ_t logp_t) = adv·∇s_i, i.e. exactly GSPO's sequence objective when ``adv`` is a
sequence advantage; token-level advantages are allowed as in the paper's GSPO-token.

**Defaults**

- ``eps_low = 3e-4``, ``eps_high = 4e-4`` [PAPER] the left/right clipping ranges of the experiments.
- The paper optimises the sequence mean, 1/G Σ_i; use ``agg = "seq_mean_token_mean"`` to
  reproduce it [PAPER]. The token form and a broadcast sequence ratio (TRL ``importance_sampling_level=
  "sequence"``) have the same value; their gradients agree only when the advantage is constant
  within each row (a sequence advantage) and the aggregation weighs a row's tokens equally (all
  built-ins do). With token-level advantages they differ: the token form weighs ∇logp_t by its own
  A_t, the broadcast ratio by the row's mean-weighted sum.

**Notes**

1. |y| counts ``rollout.mask`` tokens of the row, not token weights: the ratio is a property of
   the sequence likelihood. A row with no tokens has log_s = 0.
2. With one-token completions ``ratio`` equals PPO's token ratio in value and gradient, so
   ``gspo`` equals ``ppo_clip`` with the same eps (tests/test_equivalences.py).
3. On-policy, ratio = 1 and ∇ratio_t = ∇logp_t: the gradient is the token-level REINFORCE
   gradient, which under ``seq_mean_token_mean`` is the sequence-level REINFORCE gradient
   adv·∇mean_t(logp) that GSPO reduces to.
4. Statistics are those of ``ppo_clip`` evaluated on the sequence ratio.
5. ``seq_log_ratio`` is the shared primitive (specs/README ``seq_ratio``, in log space).
6. ``span = "segment"`` (design M5; spec 23 GAGPO's action-level ratio, [INFERRED] form): the
   "sequence" is one segment (``segment_id``, a multi-turn episode's turn), not the row::

       log_s_{i,k} = Σ_{t: seg(t)=k} mask·(logp − logp_old) / |{t: seg(t)=k, mask}|     # [b,G,S]
       ratio_t     = exp(sg[log_s_{i,seg(t)}] + logp_t − sg[logp_t])

   Tokens in no segment (``segment_id = −1``) get no loss (0). A batch without ``segment_id`` fails
   with the fix. ``span = "row"`` is the term above, unchanged (byte-identical: a test).
7. ``length_norm = false`` (an option, not the paper's; first consumer 22 GRIP-VLM, whose "sequence" is
   an ordered selection of k items): log_s = Σ_t mask·(logp − logp_old), the ratio of the whole
   sequence's likelihood. The token form keeps ratio_t = s_i on every token and ∇ratio_t = s_i∇logp_t,
   so under ``agg = "seq_mean_token_sum"`` the gradient is exactly that of 1/n Σ_i min(s_i A_i,
   clip(s_i) A_i) (the loss value is |y| times it); under ``seq_mean_token_mean`` it is 1/|y| of it.
   With ``span = "row"`` only (a segment is a turn, not the whole selection): the build refuses the pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.losses._common import check_clip, clip_stats, clipped_surrogate, required, term_mask, token_advantages
from groupwise.masked import masked_input, masked_mean
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def seq_log_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor, length_norm: bool = True) -> Tensor:
    """[b,G] sequence log-ratio over mask of (logp − logp_old): the mean over tokens (length-normalised),
    or the sum with ``length_norm=False`` (Note 6)."""
    if not length_norm:
        return ((logp - logp_old) * mask).sum(-1)  # [b,G]
    return masked_mean(logp - logp_old, mask, dim=-1)  # [b,G]


def segment_log_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor, segment_id: Tensor) -> Tensor:
    """[b,G,T] each token's segment's length-normalised log-ratio (Note 6), 0 where ``mask`` is off or
    the token is in no segment (``segment_id`` [b,G,T] long, −1: none)."""
    on = mask & (segment_id >= 0)  # [b,G,T]
    S = int(segment_id.max().clamp(min=0)) + 1
    seg = segment_id.clamp(min=0)  # [b,G,T] (off tokens add 0 below)
    diff = torch.where(on, logp - logp_old, torch.zeros((), dtype=logp.dtype))  # [b,G,T]
    total = torch.zeros(*seg.shape[:2], S, dtype=logp.dtype).scatter_add_(-1, seg, diff)  # [b,G,S]
    count = torch.zeros(*seg.shape[:2], S, dtype=logp.dtype).scatter_add_(-1, seg, on.to(logp.dtype))  # [b,G,S]
    log_s = total / count.clamp(min=1)  # [b,G,S]
    return torch.where(on, log_s.gather(-1, seg), torch.zeros((), dtype=logp.dtype))  # [b,G,T]


@register("objective", "gspo")
@dataclass
class GSPO:
    """Sequence-level ratio, clipped per sequence, in the GSPO-token form (GSPO, Zheng et al. 2025)."""

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    coef: float = 1.0
    agg: str | None = None
    span: str = "row"  # "row": one ratio per row | "segment": one per segment_id (a turn; Note 6)
    # false: the ratio is exp(Σ_t (logp − logp_old)), the whole row's likelihood ratio (Note 7; span "row") [INFERRED]
    length_norm: bool = True

    needs = ()

    def __post_init__(self) -> None:
        check_clip("gspo", self.eps_low, self.eps_high)
        if self.span not in ("row", "segment"):
            raise ConfigError(f"objective gspo: span must be 'row' or 'segment', got {self.span!r}")
        if self.span == "segment" and not self.length_norm:
            raise ConfigError("objective gspo: length_norm=false is the whole row's ratio; use it with span='row'")

    def _ratio_adv(self, mb: Rollout, out: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        mask, segment_id = term_mask(mb), mb.segment_id  # [b,G,T], [b,G,T] or None
        if self.span == "segment":
            if segment_id is None:
                raise ConfigError(
                    "objective gspo(span='segment') needs rollout.segment_id (the turns of a multi-turn "
                    "transcript): use rollout.name='episodes', or span='row'"
                )
            mask = mask & (segment_id >= 0)  # [b,G,T] tokens in no segment get no loss
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        logp_old = masked_input(required(mb, "logp_old", "gspo"), mask)  # [b,G,T]
        if segment_id is not None and self.span == "segment":
            log_s = segment_log_ratio(logp, logp_old, mask, segment_id)  # [b,G,T]
            ratio = torch.exp(log_s.detach() + logp - logp.detach())  # [b,G,T]
        else:
            log_s = seq_log_ratio(logp, logp_old, mask, self.length_norm)  # [b,G]
            ratio = torch.exp(log_s.detach()[..., None] + logp - logp.detach())  # [b,G,T]
        adv = token_advantages(mb, mask, "gspo")  # [b,G,T]
        return ratio, adv

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        ratio, adv = self._ratio_adv(mb, out)  # [b,G,T], [b,G,T]
        return clipped_surrogate(ratio, adv, self.eps_low, self.eps_high)  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv = self._ratio_adv(mb, out)  # [b,G,T], [b,G,T]
        return clip_stats(ratio, adv, self.eps_low, self.eps_high)
