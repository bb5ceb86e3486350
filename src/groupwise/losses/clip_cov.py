"""Clip-Cov and KL-Cov: restrain the few tokens whose log-prob/advantage covariance drives entropy collapse.

"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models", Ganqu Cui, Yuchen
Zhang, Jiacheng Chen, Lifan Yuan, Zhi Wang, Yuxin Zuo, Haozhan Li, Yuchen Fan, Huayu Chen, Weize Chen
et al., 2025. https://arxiv.org/abs/2505.22617 — reference implementation: verl
``verl/trainer/ppo/core_algos.py``, ``compute_policy_loss_clip_cov`` and ``compute_policy_loss_kl_cov``
(from the authors' PRIME-RL/Entropy-Mechanism-of-RL).

**Change vs GRPO**: the paper shows that entropy falls by the covariance between a token's log-prob
and its advantage; both methods act on the tokens where that covariance is largest.

- ``clip_cov``: PPO-clip, but a random ``clip_cov_ratio`` share of the tokens whose covariance lies
  in (lb, ub) gets no loss and no gradient.
- ``kl_cov``: the *unclipped* ratio objective −A·ratio, plus ``kl_coef·|logp − logp_old|`` on the
  top ``kl_cov_ratio`` share of tokens by covariance.

**Math** (``mask`` = loss tokens of the statistic batch, Note 1; means are over ``mask``)::

    cov     = (adv - mean(adv)) * (logp_cov - mean(logp_cov))    logp_cov = logp_old | sg[logp]
    ratio   = exp(logp - logp_old)
    clip_cov:
      clipped = -adv*clip(ratio, 1-eps_low, 1+eps_high) > -adv*ratio          (PPO clip active)
      cand    = mask & (clip_cov_lb < cov < clip_cov_ub)  [& ~clipped: cov_logp = "current"]
      n_clip  = max(int(clip_cov_ratio * Σ mask), 1)
      sel     = n_clip tokens of cand drawn uniformly (all of cand if fewer)
      loss    = max(-adv*ratio, -adv*clip(ratio, ...)) * (1 - (sel & ~clipped))
    kl_cov:
      k       = max(int(kl_cov_ratio * Σ mask), 1)
      sel     = the k tokens of mask with the largest cov
      loss    = -adv*ratio + sel * kl_coef * |logp - logp_old|

**Defaults**

- ``clip_cov_ratio = 2e-4``, ``clip_cov_lb = 1.0``, ``clip_cov_ub = 5.0`` [CODE] verl
  ``actor.yaml`` ``policy_loss`` (also the authors' ``recipe/dapo/7b_clip_cov.sh``).
- ``eps_low = eps_high = 0.2`` [CODE] verl ``clip_ratio``; the authors' Clip-Cov recipe sets both to 1.
- ``kl_cov_ratio = 2e-4`` [CODE] verl; the authors' recipes: 2e-3 (7B) and 2e-4 (32B), ``k_percent`` in %.
- ``kl_coef = 0.1`` [CODE] verl ``actor.yaml`` ``ppo_kl_coef`` (the function's fallback and the
  authors' recipes: 1.0).
- ``cov_logp = "old"`` [INFERRED] no-grad ``logp_old`` over the whole step batch (Note 1);
  ``"current"`` [CODE] verl: the detached current log-probs of the rows the term is given.

**Notes**

1. Scope. verl computes the covariance, its means, ``n_clip``/``k`` and the selection inside the
   loss function, i.e. per micro-batch per GPU (``dp_actor.update_policy``), from the current log-probs.
   Here (``cov_logp = "old"``) they come from no-grad inputs — ``logp_old`` (``Need("logp")``) and the
   advantages — and :meth:`prepare` computes them once on the whole step batch (all ranks), storing the
   selection as token extra ``"<name>.select"`` that micro-batches carry: loss and gradient then do
   not depend on the micro-batch split or world size. Without it (a trainer that does not call
   ``prepare``) the term computes the same thing on the rows it is given: the mini-batch under the
   default ``train.micro_batch_groups``, else each micro-batch, as verl does. ``"current"`` is always
   verl's per-call statistic. On-policy (epoch 0) ``logp == logp_old``, so both agree there.
2. Randomness: verl draws with ``torch.randperm`` (global RNG). Here each token has a priority
   u ∈ [0, 1) hashed from (seed, step, prompt id, the row's completion tokens, t) and ``sel`` is the
   ``n_clip`` candidates of smallest u — a uniform random subset, reproducible on resume and
   independent of row order and split. Identical completions of a group tie; the earlier row is taken
   (the copies have identical gradients, so which one is dropped changes nothing).
3. ``prepare`` selects before the current ratio exists; a selected token that PPO already clips is
   left as it is (it has no gradient anyway). verl (``"current"``) excludes clipped tokens before
   drawing, so it draws replacements. Identical whenever nothing is clipped (on-policy).
4. Exactly ``n_clip`` / ``k`` tokens are selected, as in verl; ties at the k-th covariance (KL-Cov)
   go to the earlier position [INFERRED] (``torch.topk`` picks one arbitrarily).
5. ``clip_cov`` sets ``on_policy_reinforce = False``: its selected tokens lose their gradient even
   on-policy — that is the method. ``kl_cov`` on-policy is REINFORCE (∂|d|/∂d = 0 at d = 0).
6. ``mask`` = valid completion tokens not removed by a token weight (``extras["counted"]``), as in
   ``Objective.loss_mask``; statistics: ``cov_clip`` / ``cov_kl`` (share of selected tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.losses._common import check_clip, ratio_and_adv, required, term_mask, token_advantages
from groupwise.masked import masked_input, masked_mean
from groupwise.registry import register
from groupwise.types import Need, Rollout, StepInfo

_M = 2_147_483_647  # the prime 2^31 − 1: a product of two residues fits in int64


def _mix(x: Tensor, v) -> Tensor:
    x = ((x ^ (v % _M)) * 48271 + 11) % _M  # [...] int64 in [0, M)
    return x ^ (x >> 9)


def token_priority(mb: Rollout, info: StepInfo) -> Tensor:
    """[b,G,T] float64 in [0,1): a hash of (seed, step, prompt id, the row's completion, t)."""
    T = mb.shape[2]
    tok = torch.where(mb.mask, mb.actions.long() + 1, torch.zeros((), dtype=torch.long)) % _M  # [b,G,T]
    pw = torch.tensor([pow(131, t + 1, _M) for t in range(T)], dtype=torch.long)  # [T]
    x = ((tok * pw) % _M).sum(-1) % _M  # [b,G] row hash (padding-length independent)
    x = _mix(_mix(_mix(x, int(info.seed)), int(info.step)), mb.prompt_index.long()[:, None])  # [b,G]
    x = _mix(x[..., None], torch.arange(T))  # [b,G,T]
    for _ in range(3):
        x = _mix(x, 0)
    return x.double() / _M  # [b,G,T]


def first_k(flags: Tensor, key: Tensor, k: int) -> Tensor:
    """[b,G,T] bool: the ``k`` entries of ``flags`` with the smallest ``key``; ties go to the earlier position."""
    idx = flags.flatten().nonzero().squeeze(1)  # [n] flat positions
    keep = idx[torch.argsort(key.flatten()[idx], stable=True)[:k]]  # [min(n,k)]
    out = torch.zeros(flags.numel(), dtype=torch.bool)  # [b·G·T]
    out[keep] = True
    return out.view(flags.shape)  # [b,G,T]


def stat_mask(mb: Rollout) -> Tensor:
    mask = term_mask(mb)  # [b,G,T]
    return mask & mb.extras["counted"].bool() if "counted" in mb.extras else mask


def covariance(adv: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """[b,G,T] (adv − mean adv)·(logp − mean logp), means over ``mask``; 0 outside it."""
    cov = (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))  # [b,G,T]
    return torch.where(mask, cov, torch.zeros((), dtype=cov.dtype))


class _CovTerm:
    """Shared: the covariance statistic and its selection, from ``prepare`` or computed on ``mb``."""

    coef: float
    cov_logp: str

    @property
    def needs(self) -> tuple[Need, ...]:
        return (Need("logp"),) if self.cov_logp == "old" else ()

    def _check(self, ratio: float) -> None:
        if self.cov_logp not in ("old", "current"):
            raise ValueError(f"{self.registry_name}: cov_logp must be 'old' or 'current', got {self.cov_logp!r}")
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"{self.registry_name}: the selected share must be in (0, 1], got {ratio}")

    def _select(self, mb: Rollout, cov: Tensor, mask: Tensor, exclude: Tensor, info: StepInfo) -> Tensor: ...

    def _selection(
        self, mb: Rollout, out: dict[str, Tensor] | None, info: StepInfo, exclude: Tensor | None = None
    ) -> Tensor:
        key = f"{self.registry_name}.select"
        mask = stat_mask(mb)  # [b,G,T]
        if self.cov_logp == "old" and key in mb.extras:
            return mb.extras[key].bool() & mask  # [b,G,T] whole-batch selection from prepare
        # [b,G,T]
        logp = required(mb, "logp_old", self.registry_name) if self.cov_logp == "old" else out["logp"].detach()
        cov = covariance(token_advantages(mb, mask, self.registry_name), masked_input(logp, mask), mask)  # [b,G,T]
        if exclude is None or self.cov_logp == "old":
            exclude = torch.zeros_like(mask)  # [b,G,T]
        return self._select(mb, cov, mask, exclude, info)  # [b,G,T]

    def prepare(self, batch: Rollout, info: StepInfo) -> None:
        """Once per step on the whole batch (after advantages and token weights): store the selection."""
        if self.cov_logp == "old":
            batch.extras.pop(f"{self.registry_name}.select", None)
            batch.set_extra(f"{self.registry_name}.select", self._selection(batch, None, info), "token")


@register("objective", "clip_cov")
@dataclass
class ClipCov(_CovTerm):
    """PPO-clip with a random few high-covariance tokens removed from the loss (Clip-Cov, Cui et al. 2025)."""

    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    eps_low: float = 0.2
    eps_high: float = 0.2
    cov_logp: str = "old"
    coef: float = 1.0
    agg: str | None = None

    on_policy_reinforce = False  # selected tokens lose their gradient even on-policy (Note 5)

    def __post_init__(self) -> None:
        check_clip("clip_cov", self.eps_low, self.eps_high)
        self._check(self.clip_cov_ratio)
        self._info = StepInfo(0, 0, 0)

    def _select(self, mb, cov, mask, exclude, info) -> Tensor:
        cand = mask & (cov > self.clip_cov_lb) & (cov < self.clip_cov_ub) & ~exclude  # [b,G,T]
        n_clip = max(int(self.clip_cov_ratio * int(mask.sum())), 1)
        if int(cand.sum()) <= n_clip:
            return cand  # [b,G,T]
        return first_k(cand, token_priority(mb, info), n_clip)  # [b,G,T]

    def _parts(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> tuple[Tensor, Tensor, Tensor]:
        ratio, adv = ratio_and_adv(mb, out, "clip_cov")  # [b,G,T], [b,G,T]
        pg1 = -adv * ratio  # [b,G,T]
        pg2 = -adv * ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)  # [b,G,T]
        clipped = (pg2 > pg1) & stat_mask(mb)  # [b,G,T]
        drop = self._selection(mb, out, info, clipped) & ~clipped  # [b,G,T]
        return torch.maximum(pg1, pg2), drop, ratio

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        self._info = info  # stats() has no info argument
        pg, drop, _ = self._parts(mb, out, info)  # [b,G,T]
        return pg * (~drop).float()  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        _, drop, ratio = self._parts(mb, out, self._info)
        return {"cov_clip": drop.float(), "ratio": ratio.detach()}  # [b,G,T]


@register("objective", "kl_cov")
@dataclass
class KLCov(_CovTerm):
    """Unclipped ratio loss + |log-ratio| penalty on the top high-covariance tokens (KL-Cov, Cui et al. 2025)."""

    kl_cov_ratio: float = 2e-4
    kl_coef: float = 0.1
    cov_logp: str = "old"
    coef: float = 1.0
    agg: str | None = None

    def __post_init__(self) -> None:
        self._check(self.kl_cov_ratio)
        if self.kl_coef < 0:
            raise ValueError(f"kl_cov: kl_coef must be >= 0, got {self.kl_coef}")

    def _select(self, mb, cov, mask, exclude, info) -> Tensor:
        n = int(mask.sum())
        if n == 0:
            return mask  # [b,G,T] all False
        return first_k(mask, -cov, max(1, int(n * self.kl_cov_ratio)))  # [b,G,T] the k largest cov

    def __call__(self, mb: Rollout, out: dict[str, Tensor], info: StepInfo) -> Tensor:
        ratio, adv = ratio_and_adv(mb, out, "kl_cov")  # [b,G,T], [b,G,T]
        mask = term_mask(mb)  # [b,G,T]
        abs_kl = (masked_input(out["logp"], mask) - masked_input(mb.logp_old, mask)).abs()  # [b,G,T]
        sel = self._selection(mb, out, info)  # [b,G,T]
        return -adv * ratio + sel.float() * self.kl_coef * abs_kl  # [b,G,T]

    def stats(self, mb: Rollout, out: dict[str, Tensor]) -> dict[str, Tensor]:
        mask = term_mask(mb)  # [b,G,T]
        # [b,G,T]
        abs_kl = (masked_input(out["logp"], mask) - masked_input(required(mb, "logp_old", "kl_cov"), mask)).abs()
        return {"cov_kl": self._selection(mb, out, StepInfo(0, 0, 0)).float(), "abs_kl": abs_kl.detach()}
