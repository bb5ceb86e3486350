"""Shapley values of a DPP log-volume game (GCPO's combinatorics, specs/35; see ``advantages/gcpo.py``).

Players are rows of ``phi`` [G,d] (reward-weighted embeddings); the team value of a coalition S is

    v(S) = log det(I_|S| + Φ_S Φ_Sᵀ),   v(∅) = 0

computed from the Cholesky factor of ``I + K_SS`` (K = Φ Φᵀ, float64): ``v = 2 Σ log diag(L)``.

- exact: v of every subset of the n non-null players, then
  ψ_i = Σ_{S ∌ i} |S|!(n−|S|−1)!/n! · (v(S ∪ i) − v(S)). For n ≤ 10 all 2^n subsets are one batch of
  masked matrices ``I + K ⊙ m mᵀ`` (a left-out player's row and column are the identity's, adding
  log 1 = 0) and one batched Cholesky. For larger n (up to 16) the subsets are grown one player at
  a time in increasing index order, each carrying the Schur complement of ``I + K`` on the players
  after its largest one: v(S ∪ k) = v(S) + log of k's pivot, and adding k eliminates its row and
  column (a rank-1 update). Every subset costs one pivot and an update of the trailing block, so 16
  players take ~30 ms instead of ~0.4 s for 65536 Cholesky factorisations (one thread). A pivot is
  ≥ 1 in exact arithmetic; one below 1, not finite, or 10^8 times smaller than its diagonal entry
  (rounding has eaten the digits: near-duplicate players with rewards beyond ~1e4) sends the game
  back to the batched Cholesky, whose eigenvalue fallback covers the factorisations that fail (near
  float64's range the log volume of ≥ 3 equal players is only guaranteed finite, not exact).
- Monte-Carlo: M random orders; in one order the leading principal minors of the permuted
  ``I + K`` are the prefix coalitions, so one Cholesky gives every marginal contribution,
  v(prefix_k) − v(prefix_{k−1}) = 2 log L_kk. ψ_i = the mean over orders. Each order's
  contributions sum to v(N), so the estimate is efficient (Σψ = v(N)) up to rounding.

Null players (a zero row of ``phi``: a wrong, invalid or empty rollout) add nothing to any
coalition, so the game is solved over the non-null players only and nulls get exactly 0 (this
is what keeps exact solving cheap when few rollouts of a large group are correct). Players with
identical rows are symmetric and get the mean of their values, so duplicates tie bit for bit.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor


def dpp_logvol(phi: Tensor) -> Tensor:
    """v(S) = log det(I + Φ Φᵀ) of ``phi`` [S,d] (a float64 scalar; 0 for S = 0)."""
    phi = phi.double()  # [S,d]
    if phi.shape[0] == 0:
        return torch.zeros((), dtype=torch.float64)
    return _prefix_gains(torch.eye(phi.shape[0], dtype=torch.float64) + phi @ phi.T).sum()


def _prefix_gains(A: Tensor) -> Tensor:
    """[...,n] log det(A[:k+1,:k+1]) − log det(A[:k,:k]) of a batch of matrices A = I + K (K a Gram matrix).

    Cholesky: the gains are 2·log diag(L). Where rounding makes I + K numerically indefinite
    (rewards near 3e38 put 1e77 beside the identity's 1), that matrix's prefixes are taken from the
    eigenvalues of K instead, clamped at 0 (K is positive semi-definite in exact arithmetic)."""
    L, info = torch.linalg.cholesky_ex(A)  # [...,n,n], [...]
    gains = 2 * L.diagonal(dim1=-2, dim2=-1).log()  # [...,n]
    bad = info != 0  # [...]
    if bad.any():
        n = A.shape[-1]
        K = A[bad] - torch.eye(n, dtype=A.dtype)  # [m,n,n]
        keep = torch.arange(n)[None, :] <= torch.arange(n)[:, None]  # [n,n] row k: the first k+1 players
        # [m,n,n,n] the k-th leading block, zero-padded
        prefix = K[:, None] * (keep[:, :, None] & keep[:, None, :])[None]
        logdet = torch.linalg.eigvalsh(prefix).clamp(min=0.0).log1p().sum(-1)  # [m,n]
        gains[bad] = torch.diff(logdet, dim=-1, prepend=torch.zeros_like(logdet[:, :1]))  # [m,n]
    return gains


@lru_cache(maxsize=16)
def _subsets(n: int) -> tuple[Tensor, Tensor, Tensor]:
    """(masks [2^n,n] bool, with_i [2^n,n] long: the index of mask ∪ {i}, weight [2^n,n] float64 of
    the term v(mask ∪ i) − v(mask): |S|!(n−|S|−1)!/n! where i ∉ mask, else 0)."""
    ids = torch.arange(2**n)  # [2^n]
    bit = 2 ** torch.arange(n)  # [n]
    masks = (ids[:, None] & bit[None, :]) > 0  # [2^n,n]
    size = masks.sum(1)  # [2^n]
    w = torch.tensor(
        [math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) if s < n else 0.0 for s in range(n + 1)],
        dtype=torch.float64,
    )  # [n+1]
    weight = torch.where(masks, 0.0, w[size][:, None])  # [2^n,n]
    return masks, ids[:, None] | bit[None, :], weight


BATCHED_MAX = 10  # up to this many players, one batched Cholesky of all 2^n subsets is the fastest
LOST_DIGITS = 1e8  # a pivot this many times below its diagonal entry has lost half of float64's digits


def _subset_values_batched(K: Tensor) -> Tensor:
    """v [2^n] of every subset (bitmask index) from one batch of masked matrices and its Cholesky."""
    n = K.shape[0]
    masks, _, _ = _subsets(n)
    pair = masks[:, :, None] & masks[:, None, :]  # [2^n,n,n]
    A = torch.eye(n, dtype=torch.float64) + torch.where(pair, K, 0.0)  # [2^n,n,n]
    return _prefix_gains(A).sum(-1)  # [2^n]


def _subset_values_grown(K: Tensor) -> Tensor | None:
    """v [2^n] of every subset, grown one player at a time (module docstring); None when a pivot is unreliable.

    The subsets whose largest player is m are one batch: their bitmasks, their v and the Schur complement
    of I + K on players m+1..n−1 after eliminating the subset, [c, n−1−m, n−1−m]."""
    n = K.shape[0]
    A = torch.eye(n, dtype=torch.float64) + K  # [n,n]
    v = torch.zeros(2**n, dtype=torch.float64)  # [2^n]
    pending: list[list[tuple[Tensor, Tensor, Tensor]]] = [[] for _ in range(n)]  # children by their largest player
    batch = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.float64), A[None])  # the empty set
    for m in range(-1, n - 1):
        if m >= 0:
            if not pending[m]:
                continue
            batch = tuple(torch.cat(part) for part in zip(*pending[m]))
            pending[m] = []
        masks, vals, block = batch  # [c], [c], [c,r,r] with r = n−1−m
        for j in range(block.shape[1]):
            k = m + 1 + j
            pivot = block[:, j, j]  # [c] exp(v(S ∪ k) − v(S)), ≥ 1 in exact arithmetic
            unreliable = ~torch.isfinite(pivot) | (pivot < 1.0 - 1e-9) | (A[k, k] / pivot > LOST_DIGITS)  # [c]
            if bool(unreliable.any()):
                return None
            child, child_v = masks | (1 << k), vals + pivot.log()  # [c], [c]
            v[child] = child_v
            if k < n - 1:  # eliminate k from the players after it: its children's Schur complement
                col = block[:, j + 1 :, j]  # [c,r']
                outer = col[:, :, None] * col[:, None, :] / pivot[:, None, None]  # [c,r',r']
                schur = block[:, j + 1 :, j + 1 :] - outer  # [c,r',r']
                pending[k].append((child, child_v, schur))
    return v


def _exact(K: Tensor) -> Tensor:
    n = K.shape[0]
    _, with_i, weight = _subsets(n)
    v = _subset_values_grown(K) if n > BATCHED_MAX else None  # [2^n]
    if v is None:
        v = _subset_values_batched(K)  # [2^n]
    return (weight * (v[with_i] - v[:, None])).sum(0)  # [n]


def _monte_carlo(K: Tensor, n_perm: int, generator: torch.Generator) -> Tensor:
    n = K.shape[0]
    order = torch.rand(n_perm, n, generator=generator, dtype=torch.float64).argsort(1)  # [M,n] random orders
    A = (torch.eye(n, dtype=torch.float64) + K)[order[:, :, None], order[:, None, :]]  # [M,n,n] permuted I + K
    gain = _prefix_gains(A)  # [M,n] gain[m,k] of player order[m,k]
    psi = torch.zeros(n, dtype=torch.float64).index_add_(0, order.flatten(), gain.flatten())  # [n]
    return psi / n_perm


def shapley_values(
    phi: Tensor, exact: bool | None = None, n_perm: int = 256, seed: int = 0, exact_max: int = 16
) -> Tensor:
    """ψ [G] float64: Shapley values of the players ``phi`` [G,d] in the game v = ``dpp_logvol``.

    ``exact`` True: over all subsets; False: ``n_perm`` seeded random orders; None: exact when at
    most ``exact_max`` players are non-null. Null rows (all zero) get exactly 0."""
    phi = phi.double()  # [G,d]
    psi = torch.zeros(phi.shape[0], dtype=torch.float64)  # [G]
    live = (phi != 0).any(1).nonzero().flatten()  # [n] the non-null players
    if live.numel() == 0:
        return psi
    rows, cls = torch.unique(phi[live], dim=0, return_inverse=True)  # identical players (symmetric)
    K = phi[live] @ phi[live].T  # [n,n]
    if exact if exact is not None else live.numel() <= exact_max:
        vals = _exact(K)  # [n]
    else:
        vals = _monte_carlo(K, n_perm, torch.Generator().manual_seed(seed))  # [n]
    # [u]
    tied = torch.zeros(rows.shape[0], dtype=torch.float64).index_add_(0, cls, vals) / torch.bincount(cls).double()
    psi[live] = tied[cls]
    return psi
