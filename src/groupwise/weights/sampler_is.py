"""Sampler/trainer mismatch correction: truncated (TIS) or masked (MIS) importance weights, and the
off-policy sequence mask (OPSM).

TIS: Feng Yao, Liyuan Liu, Dinghuai Zhang et al., "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", blog post, 2025, https://fengyao.notion.site/off-policy-rl. MIS: Jiacai Liu
et al., "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch", 2025, https://richardli.xyz/rl-collapse. OPSM: DeepSeek-AI, "DeepSeek-V3.2", 2025,
https://arxiv.org/abs/2512.02556 (eq. 9). Code: TRL 1.16 ``trl/trainer/grpo_trainer.py``
(``_generate_and_score_completions``: ``vllm_importance_sampling_*``; ``get_off_policy_mask``);
verl ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask``).

**Change vs GRPO**: GRPO assumes the tokens were sampled by the policy it trains (π_old). An
inference engine (vLLM, bf16 kernels) samples from a slightly different π_sampler; each
policy-gradient token is re-weighted by ρ = π_old/π_sampler, capped or masked where ρ is extreme.

**Math** (``mask`` = the completion tokens of valid rows; ``diff = nan→0(logp_old − logp_sampler)·mask``)::

    log_rho = diff                               mode = token_*          [B,G,T]
            = Σ_t diff  (every token of the row)  mode = sequence_*      [B,G,1]
    rho     = exp(clamp(log_rho, −20, 20))
    w       = clamp(rho, lo, hi)                  *_truncate (TIS)
            = rho · [lo ≤ rho ≤ hi]               *_mask     (MIS)
            = 1                                   mode = "none"
    keep    = adv ≥ 0  or  Σ_t mask·(logp_sampler − logp_old) / Σ_t mask ≤ off_policy_threshold
    weight  = w · keep · mask                     (keep = 1 when off_policy_threshold is None)

**Defaults**

- ``mode = "sequence_mask"``, ``hi = 3.0``, ``lo = None`` [CODE] TRL 1.16
  ``vllm_importance_sampling_mode``, ``vllm_importance_sampling_clip_max``, ``_clip_min``. verl:
  ``rollout_is = "sequence"`` truncated at ``rollout_is_threshold = 2.0`` (``sequence_truncate``,
  ``hi = 2``); the original TIS: ``token_truncate`` with ``tis_imp_ratio_cap``.
- ``off_policy_threshold = None`` (off) [CODE] TRL ``off_policy_mask_threshold``; the paper's δ.
- ``scope = "loss"`` [CODE] TRL: a masked token keeps its place in every normaliser and in the KL
  term. ``"token"`` is verl's rejection sampling (``rollout_rs``), which edits ``response_mask``, so
  rejected tokens leave the normalisers and the KL and entropy terms too.

**Notes**

1. The weight reaches each term as the term declares (``token_weights``, objective.py): it
   multiplies per-token policy-gradient losses (TRL's ``per_token_loss``), ``gmpo`` by its sequence
   geometric mean (verl's ``geo_mean``); the ``kl`` term is exempt, as in both libraries, and a term
   that cannot take it (the group contrasts) refuses the configuration. With ``scope = "loss"`` the
   MIS zeros and the OPSM drops count in the normalisers: TRL's aggregation keeps ``completion_mask``.
2. Runs once per step on the whole batch, before micro-batching, from ``logp_old`` (needs
   ``Need("logp")``) and ``logp_sampler`` (the engine's log-probs). OPSM uses ``logp_old`` as the
   current policy: TRL's ``per_token_logps`` equals it in the first pass over a rollout (one
   iteration); with several epochs TRL re-evaluates the mask with the moving policy, this does not.
3. The ±20 clamp on ``log_rho`` is verl's ``SAFETY_BOUND`` (TRL has none); it keeps weights finite
   and changes nothing unless ρ > e^20 or < e^−20. Sampler log-probs that are NaN give ρ = 1 (TRL).
   A rollout without ``logp_sampler`` (an engine that reports none) gets ρ = 1 and OPSM against
   ``logp_old`` itself, as TRL without vLLM; ``step_stats()["sampler_is/no_sampler_logp"]`` is 1 then.
4. verl's token/sequence k1 rejection keeps ``lower ≤ log(π_sampler/π_old) ≤ upper``; with its
   default symmetric bounds that is ``1/hi ≤ rho ≤ hi`` here (``lo = 1/hi``).
5. ``step_stats()`` returns the last call's ratio statistics (TRL's ``sampling/...`` metrics): mean,
   min and max of the applied weight, ``raw_max`` (verl logs the ratio before truncation), the
   fraction of tokens (token modes) or rows (sequence modes) outside [lo, hi], |logp_old −
   logp_sampler| mean and max, and the fraction of loss tokens dropped by OPSM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")
SAFETY_BOUND = 20.0


@register("weight", "sampler_is")
@dataclass
class SamplerIS:
    """ρ = π_old/π_sampler per token or sequence, truncated or masked (TIS/MIS, TRL vllm_importance_sampling)."""

    mode: str = "sequence_mask"
    hi: float | None = 3.0
    lo: float | None = None
    off_policy_threshold: float | None = None
    # "loss": zeros stay in the normalisers (TRL) | "token": they leave everything (verl rollout_rs)
    scope: str = "loss"

    needs = (Need("logp"),)
    reads_sampler_logp = True  # ρ is a ratio to the sampler's log-prob (build.check_policy_fit)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sampler_is: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.scope not in ("loss", "token"):
            raise ValueError(f"sampler_is: scope must be 'loss' or 'token', got {self.scope!r}")
        if (self.hi is not None and not self.hi > 0) or (self.lo is not None and self.lo < 0):
            raise ValueError(f"sampler_is: need hi > 0 and lo >= 0, got hi={self.hi}, lo={self.lo}")
        if self.hi is not None and self.lo is not None and self.lo > self.hi:
            raise ValueError(f"sampler_is: lo={self.lo} > hi={self.hi}")
        self._stats: dict[str, float] = {}

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if rollout.logp_old is None:
            raise ValueError(
                "sampler_is needs rollout.logp_old: declared Need('logp'), "
                "filled by the trainer before the weight stage"
            )
        mask = rollout.row_mask.bool()  # [B,G,T]
        rows = mask.any(-1)  # [B,G] rows with a loss token
        sampler = rollout.logp_sampler if rollout.logp_sampler is not None else rollout.logp_old  # [B,G,T]
        gap = rollout.logp_old.float() - sampler.float()  # [B,G,T] NaN where the engine gave none
        diff = torch.nan_to_num(gap, nan=0.0) * mask  # [B,G,T]
        seq = self.mode.startswith("sequence")
        log_rho = diff.sum(-1, keepdim=True) if seq else diff  # [B,G,1] or [B,G,T]
        rho = torch.exp(log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # [B,G,1] or [B,G,T]
        lo = self.lo if self.lo is not None else 0.0
        hi = self.hi if self.hi is not None else math.inf
        outside = (rho < lo) | (rho > hi)  # [B,G,1] or [B,G,T]
        if self.mode.endswith("truncate"):
            w = rho.clamp(min=self.lo, max=self.hi) if (self.lo, self.hi) != (None, None) else rho  # [B,G,·]
        elif self.mode.endswith("mask"):
            w = torch.where(outside, torch.zeros(()), rho)  # [B,G,·]
        else:
            w, outside = torch.ones_like(rho), torch.zeros_like(outside)  # [B,G,·]
        weight = w.expand(mask.shape) * mask  # [B,G,T]
        keep = torch.ones_like(mask)  # [B,G,T]
        if self.off_policy_threshold is not None:
            keep = self._opsm(rollout, mask).expand(mask.shape)  # [B,G,T]
            weight = weight * keep  # [B,G,T]
        self._record(w, rho, outside, gap, mask, rows[..., None] if seq else mask, keep)
        self._stats["sampler_is/no_sampler_logp"] = float(rollout.logp_sampler is None)
        return weight

    def _opsm(self, rollout: Rollout, mask: Tensor) -> Tensor:
        """[B,G,1] ([B,G,T] for token advantages) bool: keep unless adv < 0 and the row's mean KL > δ."""
        if rollout.advantages is None:
            raise ValueError(
                "sampler_is: off_policy_threshold needs rollout.advantages (the weight stage runs after them)"
            )
        sampler = rollout.logp_sampler if rollout.logp_sampler is not None else rollout.logp_old  # [B,G,T]
        kl = torch.nan_to_num(sampler.float() - rollout.logp_old.float(), nan=0.0) * mask  # [B,G,T]
        mean_kl = kl.sum(-1) / mask.sum(-1).clamp(min=1)  # [B,G]
        low_kl = mean_kl <= self.off_policy_threshold  # [B,G]
        adv = rollout.advantages.float()  # [B,G] or [B,G,T]
        adv = adv if adv.dim() == 3 else adv[..., None]  # [B,G,1] or [B,G,T]
        return (adv >= 0) | low_kl[..., None]  # [B,G,1] or [B,G,T]

    def _record(
        self, w: Tensor, rho: Tensor, outside: Tensor, gap: Tensor, mask: Tensor, sel: Tensor, keep: Tensor
    ) -> None:
        """Statistics over ``sel``: the loss tokens (token modes) or the rows with a loss token (sequence)."""
        with torch.no_grad():
            applied, raw = w.expand(sel.shape)[sel], rho.expand(sel.shape)[sel]  # [n], [n]
            delta = gap.abs()[mask & ~torch.isnan(gap)]  # [n_tok] unscored tokens left out, as TRL does
            n = max(applied.numel(), 1)
            self._stats = {
                "sampler_is/mean": float(applied.sum() / n),
                "sampler_is/min": float(applied.min()) if applied.numel() else 0.0,
                "sampler_is/max": float(applied.max()) if applied.numel() else 0.0,
                "sampler_is/raw_max": float(raw.max()) if raw.numel() else 0.0,
                "sampler_is/capped_frac": float(outside.expand(sel.shape)[sel].float().sum() / n),
                "sampler_is/logp_diff_mean": float(delta.mean()) if delta.numel() else 0.0,
                "sampler_is/logp_diff_max": float(delta.max()) if delta.numel() else 0.0,
                "sampler_is/opsm_frac": float((~keep[mask]).float().sum() / max(int(mask.sum()), 1)),
            }

    def step_stats(self) -> dict[str, float]:
        """The last call's ratio statistics (whole batch: no reduction over ranks needed)."""
        return dict(self._stats)
