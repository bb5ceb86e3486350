"""HORA: spend a fixed rollout budget where an extra rollout most likely finds a correct answer.

"Where to Spend Rollouts: Hit-Utility Optimal Rollout Allocation for Group-Based RLVR", Tao Wang,
Shuo Li, Yan Sun, Dongsheng Ding, Edgar Dobriban, 2026. https://arxiv.org/abs/2605.07114 — spec
53. Only the abstract was available; no code.

**Change vs GRPO**: GRPO samples the same G rollouts for every prompt. HORA gives prompt x
``m_x`` (more) rollouts, with ``Σ_x m_x = M``, chosen to maximise the summed posterior probability
that each prompt's rollouts contain at least one correct answer (a "hit"). Rewards and the group
advantage are unchanged (groups become ragged). The rollout strategy ``hora`` (``rollout.name =
"hora"``) spends the step's budget in two rounds: ``initial`` rollouts per prompt, then the rest by
the greedy allocation below, the new rows joining their prompt's group.

**Math** (``s`` successes in ``n`` observed rollouts, Beta(a0, b0) prior)::

    a = a0 + s,  b = b0 + n − s
    U(m) = 1 − E_post[(1 − p)^m] = 1 − Π_{j<m} (b + j) / (a + b + j)
    Δ(m) = U(m+1) − U(m)  = Π_{j<m} (b + j) / (a + b + j) · a / (a + b + m)
    hora_allocate: start at m = min_alloc, then hand out the budget one rollout at a time to
                   argmax_x Δ_x(m_x) (lowest index on ties), never past max_alloc

Strategy (``B = rollout.prompts_per_step``, budget ``M = budget or B · rollout.group_size``)::

    ids    = ctx.draw(B)
    first  = ctx.rollout([Request(i, n=initial) for i in ids])             # scored
    s, n   = rows with reward >= correct_at per group, valid rows per group
    m      = hora_allocate(s, n, M − B·initial, a0, b0, 0, max_per_prompt − initial, only_unsolved)
    second = ctx.rollout([Request(i, n=m_i, offset=initial) for i with m_i > 0])
    batch  = first.join_rows(second, ...)  → groups of initial + m_i valid rows (padding invalid)
    return batch[ctx.keep(batch)]

**Defaults**

- ``a0 = b0 = 1`` (uniform prior) [ABSTRACT] "a uniform prior is competitive with" learned priors.
- Beta–Binomial posterior and the product form of U [INFERRED] standard conjugate algebra; the
  paper's exact predictor is not verified.
- greedy allocation [INFERRED] Δ(m) is strictly decreasing in m (U is concave), so the greedy is
  optimal for ``max Σ U_x(m_x)`` under ``Σ m_x = M`` and per-prompt bounds.
- ``min_alloc = 0``, ``max_alloc = None`` [INFERRED] spec 53 ``min_per_prompt`` /
  ``max_per_prompt``; set ``min_alloc >= 2`` when the extra rollouts alone form a GRPO group.
- ``only_unsolved = False`` [INFERRED] whether the paper restricts the utility to prompts without
  a success yet is unknown; ``True`` holds prompts with ``s > 0`` at ``min_alloc``.
- Strategy: ``initial = 4`` [INFERRED] half of the compute-matched 8 per prompt, the spec's
  ``two_stage`` mode (the paper's allocation-batch schedule is not known); ``budget = None`` (= B ·
  ``rollout.group_size``, compute-matched with GRPO) [ABSTRACT] "compute-matched GRPO";
  ``max_per_prompt = None`` (no cap) [INFERRED]; ``correct_at = 1.0`` [INFERRED] a row counts as a
  hit when its total reward reaches 1 (binary verifiable rewards).

**Notes**

1. ``budget`` counts every allocated rollout, the ``min_alloc`` floor included; a budget below
   ``B · min_alloc`` is an error. The result sums to ``min(budget, capacity)``: rollouts that no
   eligible prompt may take (every one at ``max_alloc``, or, with ``only_unsolved``, no unsolved
   prompt) are left unspent rather than forced onto a prompt.
2. The greedy compares the gains as exact rationals (``fractions.Fraction`` of the float inputs):
   exact ties are common with integer counts (Δ_(0,4)(1) = Δ_(4,4)(1) = 5/42) and float rounding
   would break them by computation order instead of by index.
3. Counts may be fractional (decayed history counts); they need ``0 <= s <= n``.
4. The strategy takes its counts from a first round of ``initial`` rollouts (the spec's
   ``two_stage``); the spec's ``history`` mode (counts from earlier epochs) is not implemented.
5. Groups are ragged: a prompt has ``initial + m_i`` valid rows and the step's batch is padded to
   the largest; every estimator reads ``group_valid``, so GRPO and RLOO run unchanged on them. The
   sampler's ``keep`` runs once on the joined batch (no refill rounds).
6. Row ``j`` of the second round samples with index ``initial + j``: fresh samples of the prompt.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.types import Request, Rollout


def _posterior(s, n, a0: float, b0: float, who: str) -> tuple[Tensor, Tensor]:
    """(a [B], b [B]) float64 Beta posterior parameters, after validating the counts and prior."""
    s = torch.as_tensor(s, dtype=torch.float64)  # [B]
    n = torch.as_tensor(n, dtype=torch.float64)  # [B]
    if s.shape != n.shape or s.dim() != 1:
        raise ValueError(f"{who}: s and n must be 1-D of the same length, got {tuple(s.shape)} and {tuple(n.shape)}")
    if not (torch.isfinite(s).all() and torch.isfinite(n).all()) or (s < 0).any() or (s > n).any():
        raise ValueError(f"{who}: counts need 0 <= s <= n (finite), got s={s.tolist()} n={n.tolist()}")
    if not (a0 > 0 and b0 > 0):
        raise ValueError(f"{who}: the Beta prior needs a0 > 0 and b0 > 0, got a0={a0} b0={b0}")
    return a0 + s, b0 + n - s  # [B], [B]


def _log_miss(a: Tensor, b: Tensor, m: Tensor) -> Tensor:
    """[B] float64 log E[(1 − p)^m] = log B(a, b+m) − log B(a, b), via lgamma (any m >= 0)."""
    log_q = torch.lgamma(b + m) + torch.lgamma(a + b) - torch.lgamma(b) - torch.lgamma(a + b + m)  # [B]
    # the lgamma terms cancel only to ~1e-13: U(0) = 0 exactly
    return torch.where(m == 0, torch.zeros_like(log_q), log_q)


def _as_m(m, like: Tensor, who: str) -> Tensor:
    m = torch.as_tensor(m, dtype=torch.float64).expand_as(like)  # [B]
    if (m < 0).any() or (m != m.round()).any():
        raise ValueError(f"{who}: m must be non-negative integers, got {m.tolist()}")
    return m


def hit_utility(s, n, m, a0: float = 1.0, b0: float = 1.0) -> Tensor:
    """U [B] float32: posterior probability that ``m`` more rollouts of each prompt contain a hit."""
    a, b = _posterior(s, n, a0, b0, "hit_utility")  # [B], [B]
    m = _as_m(m, a, "hit_utility")  # [B]
    return (-torch.expm1(_log_miss(a, b, m))).float()  # [B]; 1 − q without cancellation for q ≈ 1


def marginal_gain(s, n, m, a0: float = 1.0, b0: float = 1.0) -> Tensor:
    """Δ [B] float32 = U(m+1) − U(m): the hit probability one more rollout adds to each prompt."""
    a, b = _posterior(s, n, a0, b0, "marginal_gain")  # [B], [B]
    m = _as_m(m, a, "marginal_gain")  # [B]
    return (_log_miss(a, b, m).exp() * a / (a + b + m)).float()  # [B]


def hora_allocate(
    s,
    n,
    budget: int,
    a0: float = 1.0,
    b0: float = 1.0,
    min_alloc: int = 0,
    max_alloc: int | None = None,
    only_unsolved: bool = False,
) -> Tensor:
    """m [B] int64: greedy hit-utility allocation of ``budget`` rollouts (see the module notes)."""
    a_t, b_t = _posterior(s, n, a0, b0, "hora_allocate")  # [B], [B]
    B = a_t.numel()
    if isinstance(budget, bool) or int(budget) != budget or budget < 0:
        raise ValueError(f"hora_allocate: budget must be an integer >= 0, got {budget!r}")
    if int(min_alloc) != min_alloc or min_alloc < 0:
        raise ValueError(f"hora_allocate: min_alloc must be an integer >= 0, got {min_alloc!r}")
    if max_alloc is not None and (int(max_alloc) != max_alloc or max_alloc < min_alloc):
        raise ValueError(
            f"hora_allocate: max_alloc must be an integer >= min_alloc={min_alloc} (or None), got {max_alloc!r}"
        )
    if budget < B * min_alloc:
        raise ValueError(
            f"hora_allocate: budget {budget} cannot give {B} prompts "
            f"min_alloc={min_alloc} each; raise the budget or lower min_alloc"
        )
    m = [int(min_alloc)] * B
    left = int(budget) - B * int(min_alloc)
    solved = (torch.as_tensor(s, dtype=torch.float64) > 0).tolist()
    A = [Fraction(float(x)) for x in a_t.tolist()]  # exact rationals of the float inputs (note 2)
    Bb = [Fraction(float(x)) for x in b_t.tolist()]
    miss = []  # miss[i] = E[(1 − p)^m_i] exactly
    heap: list[tuple[Fraction, int]] = []
    for i in range(B):
        q = Fraction(1)
        for j in range(m[i]):
            q *= (Bb[i] + j) / (A[i] + Bb[i] + j)
        miss.append(q)
        eligible = not (only_unsolved and solved[i]) and (max_alloc is None or m[i] < max_alloc)
        if eligible:
            # (−Δ_i(m_i), index): min-heap pops max gain, lowest index
            heap.append((-(q * A[i] / (A[i] + Bb[i] + m[i])), i))
    heapq.heapify(heap)
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        miss[i] *= (Bb[i] + m[i]) / (A[i] + Bb[i] + m[i])
        m[i] += 1
        left -= 1
        if max_alloc is None or m[i] < max_alloc:
            heapq.heappush(heap, (-(miss[i] * A[i] / (A[i] + Bb[i] + m[i])), i))
    return torch.tensor(m, dtype=torch.int64)  # [B]


@register("rollout", "hora")
@dataclass
class HORA:
    """HORA: a first round of rollouts per prompt, then the rest of the budget where an extra rollout most likely hits
    (Wang et al. 2026)."""

    initial: int = 4
    budget: int | None = None
    max_per_prompt: int | None = None
    correct_at: float = 1.0
    a0: float = 1.0
    b0: float = 1.0
    only_unsolved: bool = False

    def __post_init__(self) -> None:
        if self.initial < 1 or (self.max_per_prompt is not None and self.max_per_prompt < self.initial):
            raise ConfigError(
                "rollout hora: need initial >= 1 and max_per_prompt >= initial, "
                f"got initial={self.initial}, max_per_prompt={self.max_per_prompt}"
            )

    def __call__(self, ctx) -> Rollout:
        B = ctx.batch_size
        budget = self.budget if self.budget is not None else B * ctx.group_size
        if budget < B * self.initial:
            raise ConfigError(
                f"rollout hora: budget={budget} is less than initial={self.initial} rows for each of {B} prompts"
            )
        ids = ctx.draw(B)
        first = ctx.rollout([Request(key=i, n=self.initial) for i in ids])
        hits = ((first.rewards >= self.correct_at) & first.group_valid).sum(1)  # [B]
        seen = first.group_valid.sum(1)  # [B]
        cap = None if self.max_per_prompt is None else self.max_per_prompt - self.initial
        extra = hora_allocate(
            hits, seen, budget - B * self.initial, self.a0, self.b0, 0, cap, self.only_unsolved
        ).tolist()  # [B]
        chosen = [b for b in range(B) if extra[b] > 0]
        batch = first
        if chosen:
            second = ctx.rollout([Request(key=ids[b], n=extra[b], offset=self.initial) for b in chosen])
            batch = first.join_rows(second, chosen)
        keep = ctx.keep(batch)  # [B] bool
        return batch if bool(keep.all()) else batch.select(keep.nonzero().flatten())
