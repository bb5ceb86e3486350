"""The 2-bus AC power-flow toy of Newton's Lantern (spec 37): load snapshots, their high-voltage
solution, and a Newton–Raphson solver whose iteration count a warm start is judged by.

"Newton's Lantern: A Reinforcement Learning Framework for Finetuning AC Power Flow Warm Start
Models", Suri, Hilmarsson, Bose, arXiv 2605.11102 (abstract and summary only; no code). The toy is
the spec's small-scale analogue, ``../shared/design/nontext.md`` §3 "37".

**Change vs GRPO**: none; a task. A row's prompt is the observation s = (P_L, Q_L), the policy's
action a warm start x = (θ, V) for Newton–Raphson.

**Math** (a lossless line of reactance X from the slack bus 1∠0 to a load bus V∠θ; the load draws
P_L, Q_L, so the bus injects −P_L, −Q_L)::

    F(θ, V) = [ (V/X)·sin θ + P_L ,  V²/X − (V/X)·cos θ + Q_L ]          (mismatch; 0 at a solution)
    J(θ, V) = [[ (V/X)·cos θ ,  sin θ / X          ],
               [ (V/X)·sin θ ,  2V/X − cos θ / X   ]]
    NR:      x ← x − J(x)⁻¹·F(x)  until ‖F(x)‖_∞ < tol;  n = the number of updates taken

    solutions: u = V² solves u² + (2·Q_L·X − 1)·u + X²·(P_L² + Q_L²) = 0; the high-voltage root
    u⁺ = ((1 − 2Q_L X) + √Δ)/2, Δ = (1 − 2Q_L X)² − 4X²(P_L² + Q_L²); sin θ = −P_L X/V, cos θ = (V² + Q_L X)/V
    nose point (Δ = 0) at power factor k = Q_L/P_L:  P_max(k) = (√(1 + k²) − k) / (2X)
    a snapshot at load level λ:  P_L = λ·P_max(k),  Q_L = k·P_L

    label n(s, x) = n  if NR from x converges (≤ max_iter updates) to the high-voltage root
                  = n_max  otherwise (no convergence, a singular J, or the low-voltage root)

**Defaults** (all [INFERRED]: the spec's toy)

- ``X = 1.0`` (per unit), ``tol = 1e-8`` on ‖F‖_∞, ``max_iter = n_max = 20`` (the spec's "e.g. 20").
- Power factor k = tan φ ~ U(0, 0.4) (lagging loads).
- Tasks: ``powerflow2`` (the RL task; train rows λ ~ U(0.1, 0.98), test rows heavy only,
  λ ~ U(0.9, 0.98): the spec's "up to ~98 % of the nose point"); ``powerflow2_demos`` (the
  labelled demonstrations of the warm start f0: light and medium loads only, λ ~ U(0.1, 0.8),
  as the design's "train f0 on lighter loads").

**Notes**

1. Rows: ``{"prompt": [P_L, Q_L], "target": [θ, V], "load": λ, "heavy": λ >= 0.9}``; ``target`` is
   the high-voltage solution (what the sft phase fits, ``GaussianPolicy.encode_target``).
2. ``newton_raphson`` is generic and batched (F: [N,D] → [N,D], J: [N,D] → [N,D,D]); each row stops
   on its own. The spec's unit test F(x) = x² − 2 is one row of one unknown.
3. All the arithmetic is float64. A row whose iterate turns non-finite, or whose J is singular,
   stops there as not converged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch import Tensor

from groupwise.tasks import Task, register_task

X_LINE = 1.0
TOL = 1e-8
N_MAX = 20
HEAVY = 0.9  # load level from which a snapshot counts as heavy
PF_MAX = 0.4  # k = tan φ ~ U(0, PF_MAX)
TEST_SIZE = 512
TRAIN_SIZE = 4096
_SPLIT_SEED = 3737
ROOT_TOL = 1e-6  # |V − V⁺| below which a converged run found the high-voltage root


def newton_raphson(
    F: Callable[[Tensor], Tensor], J: Callable[[Tensor], Tensor], x0: Tensor, tol: float = TOL, max_iter: int = N_MAX
) -> tuple[Tensor, Tensor, Tensor]:
    """Batched Newton–Raphson from x0 [N,D]: (x [N,D], n_iter [N] int64, converged [N] bool). A row
    converges when ‖F(x)‖_∞ < tol; n_iter counts its updates (0 when x0 already satisfies it)."""
    x = x0.double().clone()  # [N,D]
    n_iter = torch.zeros(x.shape[0], dtype=torch.long)  # [N]
    converged = torch.zeros(x.shape[0], dtype=torch.bool)  # [N]
    alive = torch.ones(x.shape[0], dtype=torch.bool)  # [N] neither converged nor failed
    for it in range(max_iter + 1):
        f = F(x)  # [N,D]
        finite = torch.isfinite(f).all(-1) & torch.isfinite(x).all(-1)  # [N]
        done = alive & finite & (f.abs().amax(-1) < tol)  # [N]
        converged |= done
        n_iter[done] = it
        alive &= finite & ~done
        if it == max_iter or not alive.any():
            break
        jac = J(x[alive])  # [n,D,D]
        det_ok = torch.linalg.det(jac).abs() > 1e-14  # [n]
        step = torch.zeros_like(x[alive])  # [n,D]
        if det_ok.any():
            step[det_ok] = torch.linalg.solve(jac[det_ok], f[alive][det_ok])  # [n',D]
        idx = alive.nonzero().squeeze(-1)  # [n]
        alive[idx[~det_ok]] = False  # a singular Jacobian: no next iterate
        x[idx[det_ok]] = x[idx[det_ok]] - step[det_ok]
    n_iter[~converged] = max_iter
    return x, n_iter, converged


def mismatch(x: Tensor, s: Tensor, X: float = X_LINE) -> Tensor:
    """F [N,2] at warm starts x = (θ, V) [N,2] for snapshots s = (P_L, Q_L) [N,2]."""
    theta, v = x[:, 0], x[:, 1]
    return torch.stack([v / X * torch.sin(theta) + s[:, 0], v**2 / X - v / X * torch.cos(theta) + s[:, 1]], -1)


def jacobian(x: Tensor, X: float = X_LINE) -> Tensor:
    """J = ∂F/∂(θ, V) [N,2,2]."""
    theta, v = x[:, 0], x[:, 1]
    row_p = torch.stack([v / X * torch.cos(theta), torch.sin(theta) / X], -1)  # [N,2]
    row_q = torch.stack([v / X * torch.sin(theta), 2 * v / X - torch.cos(theta) / X], -1)  # [N,2]
    return torch.stack([row_p, row_q], -2)  # [N,2,2]


def p_max(k: float, X: float = X_LINE) -> float:
    """The nose-point active load at power factor k = Q_L/P_L."""
    return (math.sqrt(1 + k * k) - k) / (2 * X)


def solution(p: float, q: float, X: float = X_LINE) -> tuple[float, float]:
    """The high-voltage solution (θ, V) of a snapshot below the nose point."""
    b = 1 - 2 * q * X
    disc = b * b - 4 * X * X * (p * p + q * q)
    if disc < 0:
        raise ValueError(f"powerflow2: the load (P_L={p}, Q_L={q}) is past the nose point (no solution at X={X})")
    v = math.sqrt((b + math.sqrt(disc)) / 2)
    return math.atan2(-p * X / v, (v * v + q * X) / v), v


def iterations(x0: Tensor, s: Tensor, n_max: int = N_MAX, tol: float = TOL, X: float = X_LINE) -> tuple[Tensor, Tensor]:
    """(label [N] float64, solved [N] bool) of warm starts x0 [N,2] on snapshots s [N,2]: the NR update count
    when NR reaches the high-voltage root within ``n_max`` updates, else ``n_max`` (module docstring)."""
    s = s.double()
    x, n, converged = newton_raphson(lambda x: mismatch(x, s, X), lambda x: jacobian(x, X), x0, tol, n_max)
    v_high = torch.tensor([solution(p, q, X)[1] for p, q in s.tolist()], dtype=torch.float64)  # [N]
    solved = converged & ((x[:, 1] - v_high).abs() < ROOT_TOL)  # [N] the low-voltage root is a failure
    return torch.where(solved, n.double(), torch.full_like(n, n_max, dtype=torch.float64)), solved


def snapshot(load: float, k: float, X: float = X_LINE) -> dict:
    """One row (Note 1) at load level ``load`` and power factor ``k``."""
    p = load * p_max(k, X)
    q = k * p
    theta, v = solution(p, q, X)
    return {"prompt": [p, q], "target": [theta, v], "load": load, "heavy": load >= HEAVY}


def _draw(n: int, lo: float, hi: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [snapshot(rng.uniform(lo, hi), rng.uniform(0.0, PF_MAX)) for _ in range(n)]


def _rows(train: tuple[float, float], test: tuple[float, float], offset: int):
    def rows(split: str, n: int, seed: int = 0) -> list[dict]:
        """``n`` rows of ``split`` (``n <= 0``: the whole split); train rows are a ``seed``-shuffled sample."""
        if split == "test":
            pool = _draw(TEST_SIZE, *test, _SPLIT_SEED + offset)
        elif split == "train":
            pool = _draw(TRAIN_SIZE, *train, _SPLIT_SEED + offset + 1)
            if n > 0:
                random.Random(seed).shuffle(pool)
        else:
            raise ValueError(f"powerflow2 has splits 'train' and 'test', not {split!r}")
        return pool[:n] if n > 0 else pool

    return rows


register_task(
    Task(
        "powerflow2",
        "2-bus AC power-flow warm starts: observation (P_L, Q_L) -> (theta, V); train loads 10-98 % of the nose "
        "point, test heavy loads 90-98 %; reward nr_iterations (-Newton-Raphson updates)",
        _rows((0.1, 0.98), (HEAVY, 0.98), 0),
        reward="nr_iterations",
    )
)
register_task(
    Task(
        "powerflow2_demos",
        "labelled power-flow solutions at light and medium loads (10-80 % of the nose point): the supervised "
        "warm start f0's demonstrations (column target = (theta, V))",
        _rows((0.1, 0.8), (0.1, 0.8), 10),
        reward="nr_iterations",
    )
)
