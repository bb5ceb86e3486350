"""CovGK-GRPO: down-weight tokens whose (log-prob, advantage) covariance contribution is extreme, by a Gaussian kernel.

"Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage Reweighting", Wang,
Liu, Zhou, Chen, ACL 2026 (short). https://arxiv.org/abs/2605.11538,
https://aclanthology.org/2026.acl-short.45/ (spec: specs/33; abstract only, no code).

**Change vs GRPO**

- Each token's advantage A_t becomes w_t·A_t with w_t ∈ (0, 1]: a Gaussian kernel of the token's
  centred product of log-prob and advantage (its share of Cov(log π, A), which drives the entropy
  change under policy gradient, Cui et al. 2025), with the bandwidth taken from the batch. Tokens
  with extreme covariance, the ones that collapse or explode entropy, are smoothly down-weighted.
- A token weight (stage ``weight``): w > 0, so w·min(ρA, clip(ρ)A) = min(ρ·wA, clip(ρ)·wA) and
  weighting the PPO-clip loss is exactly the surrogate with Ã = w·A.

**Math** (over the statistics tokens of each scope: valid rows, finite values; all detached)::

    c_t   = (logp_old_t − mean(logp_old)) · (A_t − mean(A))
    mu_c  = mean(c)                (center="batch_mean")     | 0            (center="zero")
    sig_c = std(c), population     (bandwidth="std")         | rms(c)       (bandwidth="rms")
    w_t   = exp(−(c_t − mu_c)² / (2 · sig_c²))               (w ≡ 1 where sig_c = 0)

**Defaults** — every functional form is the spec's reconstruction; the abstract says only
"covariance-weighted", "Gaussian kernel" and "hyperparameter-free" [ABSTRACT].

- ``center = "batch_mean"`` [INFERRED]; ``"zero"`` an option.
- ``bandwidth = "std"`` [INFERRED] the population std of c; ``"rms"`` an option.
- ``stats_scope = "batch"`` [INFERRED] statistics over every token of the step batch; ``"group"`` per
  prompt group, ``"sequence"`` per row (with sequence-level advantages A − mean(A) is 0 within a
  row, so that scope gives w ≡ 1 unless an earlier shaper made token advantages).
- ``stats_tokens = "all"`` [INFERRED] every valid token, those of zero-advantage (constant) groups
  included, as the spec's "all valid tokens"; ``"nonzero_adv"`` only tokens with A ≠ 0.
- Log-probs: ``logp_old`` (the sampling policy) [INFERRED]. The spec's ``current_detached`` equals it
  on-policy (one epoch, one mini-batch); weights are computed once per step, before the updates.

**Notes**

1. Runs once per step on the whole (all-rank) batch, before micro-batching; reads ``logp_old``
   (declared ``Need("logp")``) and ``rollout.advantages`` ([B,G] or token [B,G,T]).
2. Statistics tokens: ``row_mask`` (valid rows, loss tokens), finite reward, finite ``logp_old`` and
   advantage. Other loss tokens get w = 1 (nothing to down-weight them for), tokens off the mask 0.
3. A centred quantity is exactly 0 in a scope where it is constant (checked by max == min, not by
   rounding), so a constant scope, a single token, or equal c everywhere gives w ≡ 1.
4. Scale-free: multiplying every A (or shifting every logp) leaves w unchanged. w ∈ (0, 1] (in
   float32 it underflows to 0 only beyond |c − mu_c| ≈ 14 sig_c); the weight stage's ``scope`` is
   ``"loss"``, so even such a token keeps its place in every normaliser.
5. ``step_stats()``: ``covgk/cov`` (mean c over the batch's statistics tokens: the token-level
   Cov(logp, A)), ``covgk/w_mean``, ``covgk/w_min`` and ``covgk/low_frac`` (w < 0.5; the spec
   expects it small).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo

CENTERS = ("batch_mean", "zero")
BANDWIDTHS = ("std", "rms")
SCOPES = ("batch", "group", "sequence")
STATS_TOKENS = ("all", "nonzero_adv")


def _segment_mean(x: Tensor, seg: Tensor, S: int) -> Tensor:
    """[M] values, [M] segment ids -> [S] mean per segment (0 for an empty one)."""
    total = torch.zeros(S, dtype=x.dtype).index_add_(0, seg, x)  # [S]
    count = torch.zeros(S, dtype=x.dtype).index_add_(0, seg, torch.ones_like(x))  # [S]
    return total / count.clamp(min=1)  # [S]


def _centred(x: Tensor, seg: Tensor, S: int) -> Tensor:
    """[M] x − its segment mean; exactly 0 in a segment where x is constant."""
    hi = torch.full((S,), -torch.inf, dtype=x.dtype).scatter_reduce(0, seg, x, "amax")  # [S]
    lo = torch.full((S,), torch.inf, dtype=x.dtype).scatter_reduce(0, seg, x, "amin")  # [S]
    dev = x - _segment_mean(x, seg, S)[seg]  # [M]
    return torch.where((hi > lo)[seg], dev, torch.zeros((), dtype=x.dtype))  # [M]


def cov_gaussian_weights(
    logp: Tensor, adv: Tensor, seg: Tensor, center: str = "batch_mean", bandwidth: str = "std"
) -> tuple[Tensor, Tensor]:
    """(w [M], c [M]) float64 for M statistics tokens with log-probs, advantages and scope ids ``seg`` [M] long."""
    S = int(seg.max()) + 1 if seg.numel() else 1
    logp, adv = logp.double(), adv.double()  # [M], [M]
    c = _centred(logp, seg, S) * _centred(adv, seg, S)  # [M]
    dc = _centred(c, seg, S)  # [M] c − mu_c
    off = dc if center == "batch_mean" else c  # [M]
    var = _segment_mean(dc**2 if bandwidth == "std" else c**2, seg, S)[seg]  # [M] sig_c²
    w = torch.exp(-(off**2) / (2 * torch.where(var > 0, var, torch.ones_like(var))))  # [M]
    return torch.where(var > 0, w, torch.ones_like(w)), c


@register("weight", "covgk_grpo")
@dataclass
class CovGKGRPO:
    """Gaussian-kernel down-weighting of tokens with extreme (logp, A) covariance (CovGK-GRPO, Wang et al. 2026)."""

    center: str = "batch_mean"  # "batch_mean" | "zero"
    bandwidth: str = "std"  # "std" | "rms"
    stats_scope: str = "batch"  # statistics over "batch" | "group" | "sequence"
    stats_tokens: str = "all"  # "all" | "nonzero_adv"

    needs = (Need("logp"),)
    scope = "loss"  # w > 0 on every loss token: no token leaves a normaliser either way

    def __post_init__(self) -> None:
        for key, allowed in (
            ("center", CENTERS),
            ("bandwidth", BANDWIDTHS),
            ("stats_scope", SCOPES),
            ("stats_tokens", STATS_TOKENS),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(f"covgk_grpo: {key} must be one of {allowed}, got {getattr(self, key)!r}")
        self._stats: dict[str, float] = {}

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        if rollout.logp_old is None:
            raise ValueError(
                "covgk_grpo needs rollout.logp_old: declared Need('logp'), "
                "filled by the trainer before the weight stage"
            )
        if rollout.advantages is None:
            raise ValueError(
                "covgk_grpo needs rollout.advantages (configure an advantage estimator; weights run after it)"
            )
        B, G, T = rollout.shape
        mask = rollout.row_mask.bool()  # [B,G,T]
        adv = rollout.advantages.float()  # [B,G] or [B,G,T]
        adv = (adv[..., None] if adv.dim() == 2 else adv).expand(B, G, T)  # [B,G,T]
        logp = rollout.logp_old.float()  # [B,G,T]
        ok = mask & torch.isfinite(logp) & torch.isfinite(adv)  # [B,G,T]
        if rollout.rewards is not None:
            ok = ok & torch.isfinite(rollout.rewards)[..., None]  # [B,G,T]
        if self.stats_tokens == "nonzero_adv":
            ok = ok & (adv != 0)  # [B,G,T]
        rows = {
            "batch": torch.zeros(B, G),
            "group": torch.arange(B)[:, None].expand(B, G),
            "sequence": torch.arange(B * G).view(B, G),
        }[self.stats_scope].long()  # [B,G] scope id of each row
        seg = rows[..., None].expand(B, G, T)[ok]  # [M]
        w_tok, c = cov_gaussian_weights(logp[ok], adv[ok], seg, self.center, self.bandwidth)  # [M], [M]
        weight = mask.float()  # [B,G,T] 1 on loss tokens outside the statistics, 0 off the mask
        weight[ok] = w_tok.float()
        n = max(int(ok.sum()), 1)
        self._stats = {
            "covgk/cov": float(c.sum()) / n,
            "covgk/w_mean": float(w_tok.sum()) / n,
            "covgk/w_min": float(w_tok.min()) if w_tok.numel() else 1.0,
            "covgk/low_frac": float((w_tok < 0.5).sum()) / n,
        }
        return weight  # [B,G,T]

    def step_stats(self) -> dict[str, float]:
        """The last batch's covariance and weight statistics (whole batch: no reduction over ranks)."""
        return dict(self._stats)
