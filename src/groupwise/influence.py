"""Interaction-aware group influence: first-order, pairwise and self terms of a group's effect on a
target, greedy second-order selection, and an exact ridge-regression check.

"Interaction-aware influence functions for group attribution" (POSTECH), arXiv 2605.15675,
https://arxiv.org/abs/2605.15675. Only the abstract was available: the estimator is spec 16's
derivation from it (second-order expansion of the target plus the pairwise term). The data-selection
component built on it is ``sampling/interaction_influence.py``.

Math (θ̂ trained on n examples, H = training-loss Hessian (+ damping); removing i moves θ̂ by Δθ_i)::

    Δθ_i  = (1/n) H⁻¹ ∇ℓ_i(θ̂)                         param_shifts        D [n,P]
    I_i   = ∇f(θ̂)ᵀ Δθ_i                               first-order influence
    J_ij  = Δθ_iᵀ ∇²f(θ̂) Δθ_j                          interaction (> 0 redundant, < 0 complementary)
    I_IA(S) = Σ_{i∈S} I_i + Σ_{i<j∈S} J_ij (+ ½ Σ_{i∈S} J_ii  if include_self)
    greedy add (Δθ^add = −Δθ):  S ← S ∪ argmin_j [ −I_j + Σ_{i∈S} J_ij + ½ J_jj ]   (minimise the target)

``hess`` arguments are a [P,P] matrix or a Hessian-vector product ``v[P] -> [P]`` (``torch.func.hvp``);
``H⁻¹`` likewise a [P,P] matrix (solved) or a callable ``v -> H⁻¹v``.

Notes

1. ``include_self`` defaults to True (spec 16: the paper may count self terms inside the individual
   influence; the flag keeps both readings). With a quadratic target, Σ I + Σ_{i<j} J + ½ Σ J_ii is
   exactly f(θ̂ + Σ Δθ_i) − f(θ̂): the only approximation left is Δθ_S ≈ Σ_{i∈S} Δθ_i.
2. ``greedy_select`` never forms the [n,n] matrix J: it keeps ∇²f·Δθ [n,P] and adds one column of J
   per pick, O(k·n·P) time and O(n·P) memory. Ties go to the earliest candidate in ``order``.
3. :func:`ridge_lgo_benchmark` is spec 16's behavioural check: exact leave-group-out retraining of
   a ridge regression (examples weighted 1/n throughout, the ε = −1/n removal the expansion describes)
   against the three estimators. The data generator is this module's own (the spec's is unknown).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Operator = Tensor | Callable[[Tensor], Tensor]


def apply_rows(op: Operator, V: Tensor) -> Tensor:
    """[m,P]: ``op`` (a symmetric [P,P] matrix or a vector product) applied to every row of V [m,P]."""
    if isinstance(op, Tensor):
        return V @ op.to(V.dtype)  # [m,P] (op symmetric)
    return torch.stack([op(v) for v in V]) if V.shape[0] else V.clone()  # [m,P]


def param_shifts(per_example_grads: Tensor, hvp_solver: Operator, n: int) -> Tensor:
    """D [n,P] = (1/n) H⁻¹ ∇ℓ_i: the parameter change when example i is removed."""
    g = per_example_grads.double()  # [n,P]
    if isinstance(hvp_solver, Tensor):
        return torch.linalg.solve(hvp_solver.double(), g.T).T / n  # [n,P]
    return apply_rows(hvp_solver, g) / n  # [n,P]


def influence_terms(D: Tensor, grad_f: Tensor, hess_f: Operator) -> tuple[Tensor, Tensor]:
    """(I [n], J [n,n]): first-order influences and interaction terms of the rows of D."""
    D = D.double()  # [n,P]
    return D @ grad_f.double(), D @ apply_rows(hess_f, D).T  # [n], [n,n]


def interaction_influence(
    D: Tensor, grad_f: Tensor, hess_f_vp: Operator, group: list[int], include_self: bool = True, pair: bool = True
) -> float:
    """Predicted f(θ̂ + Δθ_S) − f(θ̂) for removing ``group`` S: Σ I (+ Σ_{i<j} J) (+ ½ Σ J_ii)."""
    I, J = influence_terms(D[list(group)], grad_f, hess_f_vp)  # [s], [s,s]
    diag = J.diagonal().sum()
    total = I.sum() + (pair * (J.sum() - diag) / 2) + (include_self * diag / 2)
    return float(total)


def greedy_select(
    D: Tensor,
    grad_f: Tensor,
    hess_f_vp: Operator,
    k: int,
    include_self: bool = True,
    pair: bool = True,
    order: list[int] | None = None,
) -> list[int]:
    """k examples to add that minimise the predicted target (Δθ^add = −D): the greedy second-order rule;
    ``pair = include_self = False`` is first-order top-k. ``order`` breaks ties (default: index order)."""
    D = D.double()  # [n,P]
    n = D.shape[0]
    if not 0 <= k <= n:
        raise ValueError(f"greedy_select: k={k} must be in 0..{n}")
    HD = apply_rows(hess_f_vp, D)  # [n,P]
    gain = -(D @ grad_f.double())  # [n] I^add = ∇fᵀ(−Δθ)
    if include_self:
        gain = gain + 0.5 * (D * HD).sum(1)  # [n] ½ J_jj (signs cancel)
    order_t = torch.as_tensor(order if order is not None else range(n), dtype=torch.long)  # [n]
    taken = torch.zeros(n, dtype=torch.bool)  # [n]
    picks: list[int] = []
    for _ in range(k):
        score = torch.where(taken, torch.full_like(gain, float("inf")), gain)[order_t]  # [n] in tie-break order
        j = int(order_t[int(torch.argmin(score))])
        picks.append(j)
        taken[j] = True
        if pair:
            gain = gain + D @ HD[j]  # [n] + J_ij
    return picks


# ---------------------------------------------------------------------------------------------- ridge check
def ridge_fit(X: Tensor, y: Tensor, lam: float, keep: Tensor | None = None) -> Tensor:
    """argmin_w (1/n) Σ_{i kept} ½(x_iᵀw − y_i)² + (lam/2)‖w‖², n = len(X) whatever is kept."""
    n, d = X.shape
    k = torch.ones(n, dtype=torch.bool) if keep is None else keep  # [n]
    Xk, yk = X[k].double(), y[k].double()  # [m,d], [m]
    return torch.linalg.solve(Xk.T @ Xk / n + lam * torch.eye(d, dtype=torch.float64), Xk.T @ yk / n)  # [d]


def ridge_lgo_benchmark(
    n: int = 100,
    d: int = 5,
    groups: int = 300,
    size: int = 20,
    lam: float = 0.1,
    m: int = 50,
    noise: float = 0.5,
    seed: int = 0,
) -> dict[str, float]:
    """Pearson correlation and MAE of three estimators with the exact leave-group-out change of a
    held-out squared loss, over ``groups`` random groups of ``size`` removed examples."""
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(d, generator=g, dtype=torch.float64)  # [d]
    X, Xv = (
        torch.randn(n, d, generator=g, dtype=torch.float64),
        torch.randn(m, d, generator=g, dtype=torch.float64),
    )  # [n,d], [m,d]
    y = X @ w_true + noise * torch.randn(n, generator=g, dtype=torch.float64)  # [n]
    yv = Xv @ w_true + noise * torch.randn(m, generator=g, dtype=torch.float64)  # [m]
    f = lambda w: float(((Xv @ w - yv) ** 2).sum() / (2 * m))  # noqa: E731  held-out loss
    w = ridge_fit(X, y, lam)  # [d]
    H = X.T @ X / n + lam * torch.eye(d, dtype=torch.float64)  # [d,d]
    D = param_shifts(X * (X @ w - y)[:, None], H, n)  # [n,d]
    grad_f, hess_f = Xv.T @ (Xv @ w - yv) / m, Xv.T @ Xv / m  # [d], [d,d]
    exact, est = [], {"first": [], "first+pair": [], "first+pair+self": []}
    for _ in range(groups):
        S = torch.randperm(n, generator=g)[:size].tolist()
        keep = torch.ones(n, dtype=torch.bool)
        keep[S] = False
        exact.append(f(ridge_fit(X, y, lam, keep)) - f(w))
        est["first"].append(interaction_influence(D, grad_f, hess_f, S, include_self=False, pair=False))
        est["first+pair"].append(interaction_influence(D, grad_f, hess_f, S, include_self=False))
        est["first+pair+self"].append(interaction_influence(D, grad_f, hess_f, S, include_self=True))
    truth = torch.tensor(exact)  # [groups]
    out = {}
    for name, values in est.items():
        v = torch.tensor(values)  # [groups]
        out[f"corr/{name}"] = float(torch.corrcoef(torch.stack([v, truth]))[0, 1])
        out[f"mae/{name}"] = float((v - truth).abs().mean())
    return out
