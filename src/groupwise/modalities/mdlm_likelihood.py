"""Likelihood estimators of a masked-diffusion LM's completion: stratified masking (mean-field at K = 1)
and the Monte-Carlo masked-diffusion ELBO (K2 of ``../shared/design/nontext.md``).

A masked-diffusion LM has no tractable sequence log-likelihood; RL needs a per-token surrogate.
Sources: d1 / diffu-GRPO's one-pass "mean-field" estimate (Zhao et al. 2025,
https://arxiv.org/abs/2504.12216: every completion token predicted from the fully masked canvas);
DACA-GRPO's stratified masking likelihood (spec 54, arXiv 2605.16342, full paper not read: each
token predicted with most of the completion visible); the absorbing-state diffusion ELBO (MDLM,
Sahoo et al. 2024, https://arxiv.org/abs/2406.07524, eq. 10: a 1/t-weighted masked cross-entropy), in
LLaDA's lower-variance form with a uniform masked count l instead of a continuous t (Nie et al. 2025,
https://arxiv.org/abs/2502.09992, eq. 12: the same expectation, weight L/l).

**Math** (completion y of L positions, prompt x; ``score(canvas) = log p_θ(· | x, canvas)`` [N,L,V]
at every position, [MASK] where a position is hidden)::

    stratified(K):  strata S_1..S_K partition the positions (rank of i in a random permutation, mod K)
                    ℓ_i = log p_θ(y_i | x, y with exactly S_k masked)      for i ∈ S_k     (K forwards)
                    log π̂(y) = Σ_i ℓ_i                  K = 1: mean-field (all masked); K = L: pseudo-likelihood
    elbo(M):        l_m = ⌊(m + u)·L/M⌋ + 1, m = 0..M−1, u ~ U(0,1)  (masked counts, stratified over 1..L)
                    z_m masks a uniformly random subset of l_m positions (mask ratio t_m = l_m/L)
                    e_i = (1/M) Σ_m 1[i masked in z_m] · log p_θ(y_i | x, z_m) / t_m      (M forwards)
                    Σ_i e_i = the ELBO estimate, ≤ log p_θ(y) in expectation

**Defaults**: none here (K and M are the policy's ``estimator`` option, ``modalities/mdlm.py``).

**Notes**

1. Common random numbers: every draw of a row (its permutation, u, the masks) comes from a
   ``torch.Generator`` the caller seeds from the row (``mdlm.py``: the row extra ``mdlm_seed``), so
   the current, old and reference forwards of a row see the same strata (spec 54).
2. The weight 1/t = L/l is at most L (iid t ~ U(0,1) has an unbounded 1/t and a heavy-tailed
   estimate); with M a multiple of L every count l appears M/L times.
3. Per-token values are returned, so an objective's token-level ratio reads them like an LM's
   ``logp``; a sequence estimate is their sum over the canvas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

Score = Callable[[Tensor], Tensor]  # canvas [N,L] long -> log-probs [N,L,V] float64


def stratified_partition(L: int, K: int, gen: torch.Generator) -> Tensor:
    """[L] the stratum (0..K−1) of each position: its rank in a random permutation, mod K (sizes differ by ≤ 1)."""
    if not 1 <= K <= L:
        raise ValueError(f"stratified masking needs 1 <= K <= L (the canvas length {L}), got K={K}")
    strata = torch.empty(L, dtype=torch.long)
    strata[torch.randperm(L, generator=gen)] = torch.arange(L) % K
    return strata  # [L]


def stratified_logp(score: Score, y: Tensor, strata: Tensor, K: int, mask_id: int) -> tuple[Tensor, Tensor]:
    """[N,L] ℓ_i of each canvas token with its own stratum masked (``strata`` [N,L]): K calls of ``score``;
    and [N,L] the entropy of the distribution each ℓ_i was read from."""
    out = torch.zeros(y.shape, dtype=torch.float64)  # [N,L]
    entropy = torch.zeros(y.shape, dtype=torch.float64)  # [N,L]
    for k in range(K):
        hidden = strata == k  # [N,L]
        if not bool(hidden.any()):
            continue
        logq = score(torch.where(hidden, torch.full_like(y, mask_id), y))  # [N,L,V]
        taken = logq.gather(-1, y[..., None])[..., 0]  # [N,L]
        out = torch.where(hidden, taken, out)
        plogp = torch.where(logq.isfinite(), logq.exp() * logq, 0.0)  # [N,L,V] (0 at excluded tokens)
        entropy = torch.where(hidden, -plogp.sum(-1), entropy)
    return out, entropy  # [N,L], [N,L]


def elbo_logp(score: Score, y: Tensor, M: int, gens: Sequence[torch.Generator], mask_id: int) -> Tensor:
    """[N,L] the per-token Monte-Carlo masked-diffusion ELBO terms (M calls of ``score``; row n's draws from
    ``gens[n]``); their sum over L is the row's ELBO estimate."""
    if M < 1:
        raise ValueError(f"the Monte-Carlo ELBO needs M >= 1 mask draws, got {M}")
    N, L = y.shape
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])  # [N]
    order = torch.stack([torch.stack([torch.randperm(L, generator=g) for _ in range(M)]) for g in gens])  # [N,M,L]
    out = torch.zeros(N, L, dtype=torch.float64)  # [N,L]
    for m in range(M):
        count = torch.floor((m + u) * L / M).long().clamp(0, L - 1) + 1  # [N] masked positions, 1..L
        hidden = order[:, m] < count[:, None]  # [N,L] the positions ranked below the count
        logq = score(torch.where(hidden, torch.full_like(y, mask_id), y))  # [N,L,V]
        taken = logq.gather(-1, y[..., None])[..., 0]  # [N,L]
        t = count.double() / L  # [N] the mask ratio
        out = out + torch.where(hidden, taken / t[:, None], torch.zeros((), dtype=torch.float64)) / M
    return out  # [N,L]
