"""S-trace / P-trace: eligibility-trace importance weights over past token log-ratios, sparsified by entropy.

"Beyond Uniform Credit Assignment: Selective Eligibility Traces for RLVR", Chaoli Mou, Zhan Zhuang,
Xinning Chen, Yu Zhang, 2026. https://arxiv.org/abs/2605.05965 — specs/58 (abstract only; no code).

**Change vs GRPO**

- The per-token PPO ratio exp(logp_t − logp_old_t) becomes exp(e_t), where e_t is a normalised,
  exponentially decayed average of the log-ratios of the tokens up to t (an eligibility trace,
  P-trace). GSPO's sequence ratio is the uniform special case (``lam = 1``, the row's last trace
  on every token); ``lam = 0`` is PPO's token ratio.
- S-trace: only the top-``rho`` highest-entropy tokens of the step batch enter the trace (and, by
  default, the loss); low-entropy tokens neither carry nor receive credit.
- Clipping stays per token: only the tokens whose trace leaves [1 − eps_low, 1 + eps_high] lose
  their gradient ("partial trust-region preservation"), where GSPO drops the whole sequence.

**Math** (``mask`` = completion tokens of valid rows; ``sel`` = the trace tokens)::

    delta = logp - logp_old                                        per token
    sel   = mask                                                   mode = "p_trace"
          = mask & [H >= k-th largest H of the batch], k = ceil(rho·Σ mask)   mode = "s_trace"
    e_t   = Σ_{k<=t} lam^(t-k) sel_k delta_k / Σ_{k<=t} lam^(t-k) sel_k    (0 before the first sel token)
    e_t   = e_{T-1} for every t                                    broadcast_last = true
    ratio = exp(e_t)                                               trace_grad = "full": ∇ through every delta_k
          = exp(sg[e_t] + logp_t - sg[logp_t])                     trace_grad = "token" (GSPO-token style)
    loss  = -min(ratio·adv, clip(ratio, 1 - eps_low, 1 + eps_high)·adv) · (sel if loss_mask_mode = "selected")

**Defaults**

- ``mode = "s_trace"`` [ABSTRACT] S-trace masks low-entropy tokens out of the trace; ``"p_trace"``
  [ABSTRACT] keeps every token.
- ``lam = 0.9`` [INFERRED] (spec 58).
- ``rho = 0.2`` [INFERRED] keep the top 20 % of tokens by entropy, the 80/20 rule's share
  (weight ``top_entropy``, whose selection rule this reuses, Note 2).
- ``eps_low = eps_high = 0.2`` [INFERRED] PPO's range (the spec suggests GSPO's 3e-4 / 4e-4 as lam → 1).
- ``loss_mask_mode = "selected"`` [INFERRED] only trace tokens bear loss (their zero-loss neighbours
  still count in the normalisers, as ``top_entropy``'s ``scope = "loss"``); ``"all"``: every token.
- ``trace_grad = "full"`` [INFERRED] the gradient flows through every delta_k of the trace;
  ``"token"`` [INFERRED] keeps the trace's value but gives each token only its own ∇logp_t.
- ``broadcast_last = False`` [INFERRED] per-token traces; ``true`` is the spec's GSPO special case.

**Notes**

1. Equivalences (``tests/test_s_trace.py``, loss and gradient): ``p_trace`` with ``lam = 0`` is
   ``ppo_clip``; ``p_trace`` with ``lam = 1`` and ``broadcast_last`` is ``gspo`` with the same eps
   under a sequence advantage (both aggregations that weigh a row's tokens equally; GSPO's Note).
2. Scope: the entropy threshold is over the whole step batch. :meth:`prepare` computes the selection
   once per step from the no-grad ``Need("entropy")`` (the sampling policy's entropies) and stores
   it as token extra ``"s_trace.select"``, so loss and gradient do not depend on the micro-batch
   split or world size. Without it (no ``prepare``) the rows given are the batch. Ties and
   non-finite entropies follow ``top_entropy`` (ties at the threshold are all kept; non-finite never).
3. A trace only changes at trace tokens: at a non-trace token both sums are the previous ones times
   lam, so e_t = e at the last trace token before t. The code computes the trace at trace tokens
   (denominator >= 1, no underflow) and carries it forward. A token before the row's first trace
   token has e = 0, ratio 1 and (``trace_grad = "full"``) no gradient; a row without trace tokens
   gets no gradient. Cost: one [T,T] decay matrix, O(N·T²) (T is the completion length).
4. Masked tokens: delta is 0 and sel False outside ``mask``, so padding never enters a trace and
   gets exactly zero gradient. Constant groups (adv = 0) give loss 0.
5. On-policy (delta = 0, ratio 1) the gradient is −adv·Σ_t ∇e_t = −adv·Σ_k c_k ∇logp_k with
   c_k = Σ_{t>=k} (weight of delta_k in e_t): a different credit assignment than REINFORCE — that is
   the method (``on_policy_reinforce`` is False unless an option restores REINFORCE).
6. Statistics: ``clip_low`` / ``clip_high`` / ``ratio`` (as ``ppo_clip``, of the trace ratio) and
   ``trace_frac`` (share of loss tokens in the trace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import (
    check_clip,
    clip_stats,
    clipped_surrogate,
    loss_tokens,
    required,
    term_mask,
    token_advantages,
)
from groupwise.masked import masked_input
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo
from groupwise.weights.top_entropy import TopEntropy

MODES = ("s_trace", "p_trace")
LOSS_MASK_MODES = ("selected", "all")
TRACE_GRADS = ("full", "token")


def trace_log_ratio(delta: Tensor, sel: Tensor, lam: float) -> Tensor:
    """[...,T] normalised backward-looking trace e_t of ``delta`` over the ``sel`` tokens (0 before the first)."""
    T = delta.shape[-1]
    t = torch.arange(T)  # [T]
    gap = t[:, None] - t[None, :]  # [T,T] t − k
    # [T,T] lam^(t−k), k <= t
    decay = torch.where(gap >= 0, torch.tensor(float(lam)).pow(gap.clamp(min=0).float()), torch.zeros(()))
    w = sel.float()  # [...,T]
    num = (w * delta) @ decay.T  # [...,T] Σ_k lam^(t−k) sel_k delta_k
    den = w @ decay.T  # [...,T] >= 1 at trace tokens
    e_at = num / torch.where(sel, den, torch.ones(()))  # [...,T] the trace, valid at trace tokens
    last = torch.where(sel, t, torch.full((), -1)).cummax(-1).values  # [...,T] last trace token <= t, −1 none
    e = e_at.gather(-1, last.clamp(min=0))  # [...,T] carried forward (Note 3)
    return torch.where(last >= 0, e, torch.zeros((), dtype=e.dtype))  # [...,T]


@register("objective", "s_trace")
@dataclass
class STrace:
    """Eligibility-trace token ratios over the high-entropy tokens (S-trace / P-trace, Mou et al. 2026)."""

    mode: str = "s_trace"
    lam: float = 0.9
    rho: float = 0.2
    eps_low: float = 0.2
    eps_high: float = 0.2
    loss_mask_mode: str = "selected"
    trace_grad: str = "full"
    broadcast_last: bool = False
    coef: float = 1.0
    agg: str | None = None

    def __post_init__(self) -> None:
        check_clip("s_trace", self.eps_low, self.eps_high)
        for key, allowed in (("mode", MODES), ("loss_mask_mode", LOSS_MASK_MODES), ("trace_grad", TRACE_GRADS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"s_trace: {key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(
                f"s_trace: lam must be in [0, 1] (0 = PPO's token ratio, 1 = uniform credit), got {self.lam}"
            )
        self._select = TopEntropy(rho=self.rho)  # validates rho in (0, 1]
        self._info = StepInfo(0, 0, 0)

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need("entropy"),) if self.mode == "s_trace" else ()

    @property
    def on_policy_reinforce(self) -> bool:
        every_token = self.mode == "p_trace" or self.loss_mask_mode == "all"
        own_token = self.trace_grad == "token" or (self.lam == 0 and self.mode == "p_trace" and not self.broadcast_last)
        return every_token and own_token

    def _selection(self, mb: Rollout, info: StepInfo) -> Tensor:
        """[b,G,T] bool: the trace tokens (from :meth:`prepare` when the trainer ran it)."""
        mask = term_mask(mb)  # [b,G,T]
        if self.mode == "p_trace":
            return mask
        key = f"{self.registry_name}.select"
        if key in mb.extras:
            return mb.extras[key].bool() & mask  # [b,G,T] whole-batch selection
        if "entropy" not in mb.extras:
            raise ValueError(
                "s_trace (mode 's_trace') needs rollout.extras['entropy'] "
                "(declared Need('entropy')); or use mode='p_trace'"
            )
        return self._select(mb, info).bool() & mask  # [b,G,T] on the rows given

    def prepare(self, batch: Rollout, info: StepInfo) -> None:
        """Once per step on the whole batch: the top-rho entropy selection (Note 2)."""
        if self.mode == "s_trace":
            key = f"{self.registry_name}.select"
            batch.extras.pop(key, None)
            batch.set_extra(key, self._selection(batch, info), "token")

    def _ratio_adv(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> tuple[Tensor, Tensor, Tensor]:
        mask = term_mask(mb)  # [b,G,T]
        sel = self._selection(mb, info)  # [b,G,T]
        logp = masked_input(out["logp"], mask)  # [b,G,T]
        delta = logp - masked_input(required(mb, "logp_old", "s_trace"), mask)  # [b,G,T]
        e = trace_log_ratio(delta, sel, self.lam)  # [b,G,T]
        if self.broadcast_last:
            e = e[..., -1:].expand(e.shape)  # [b,G,T] the row's final trace (GSPO at lam = 1)
        if self.trace_grad == "token":
            e = e.detach() + logp - logp.detach()  # [b,G,T] value e_t, gradient ∇logp_t
        return torch.exp(e), token_advantages(mb, mask, "s_trace"), sel

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        self._info = info  # stats() has no info argument
        ratio, adv, sel = self._ratio_adv(mb, out, info)  # [b,G,T] ×3
        loss = clipped_surrogate(ratio, adv, self.eps_low, self.eps_high)  # [b,G,T]
        return loss * sel.float() if self.loss_mask_mode == "selected" else loss  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        ratio, adv, sel = self._ratio_adv(mb, out, self._info)  # [b,G,T] ×3
        return {**clip_stats(ratio, adv, self.eps_low, self.eps_high), "trace_frac": (sel & loss_tokens(mb)).float()}
