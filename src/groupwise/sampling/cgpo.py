"""CGPO: a variance-driven curriculum over prompts, with optional category calibration.

"Curriculum Group Policy Optimization: Adaptive Sampling for Unleashing the Potent[ial ...]" (CGPO),
CVPR 2026, https://arxiv.org/abs/2605.17807 (title as the paper note's address gives it; author names
not in the sources read; code github.com/PRIS-CV/CGPO not accessible). Formulas from a public paper
note (papernotes.org, CVPR2026) reproducing the paper's equations. Spec 05.

**Change vs GRPO**: prompts are not drawn uniformly. Each prompt keeps a sampling probability
``P_list[p]``, set from the population variance of its last groups' rewards (high variance =
partly mastered = learnable), raised by ``1/N`` every step it is not selected; a batch is filled by
Bernoulli rejection sampling. Optional categories (a dataset column) are rebalanced towards the
weaker ones by a proportional-fairness weight.

**Math** (per observed group, valid rewards ``R_{p,1..G}``; batch = the step's groups)::

    V_p      = (1/G) Σ_i (R_{p,i} − μ_p)²                          population variance
    P_var(p) = (V_p − min_b V) / (max_b V − min_b V)               (flat_value when max = min)
    P_list[p] ← mean(last `history` P_var(p))        p in the batch
    P_list[p] ← clip(P_list[p] + bonus, 0, 1)        otherwise; bonus = 1/N by default
    accept p with probability min(1, w[cat(p)] · P_list[p])        shuffled passes until n accepted
    calibration: v_i = (1/r_i) / Σ_j (1/r_j);  q_i = (1 + lam·v_i) / (c + lam);  w_i = c · q_i

**Defaults**

- ``history = 3`` [PAPER] mean over the last 3 selections (note's eq.).
- ``bonus = 0.0`` → ``1/N`` [PAPER] (N = dataset rows); a positive value overrides it.
- ``init_prob = 1.0`` [INFERRED] the note does not give the initial table value.
- ``flat_value = 1.0`` [INFERRED] P_var of every prompt when the batch has no variance spread.
- ``clip = True`` [INFERRED] the table stays in [0, 1].
- ``replace = False`` [INFERRED] a prompt is accepted at most once per batch.
- ``max_passes = 1000`` [INFERRED] rejection passes before the rest is filled uniformly (Note 3).
- ``category_column = ""`` (off) [PAPER] categories are optional; ``lam = 1.0`` [INFERRED] (λ not
  given); ``calib_every = 10`` [INFERRED] (period not given); ``w = c·q`` [INFERRED] so uniform
  q gives w = 1; ``r_floor = 1e-3`` [INFERRED] guards 1/r_i for a category with mean reward ≤ 0.

**Notes**

1. ``observe`` (called by the trainer once per step after the update, with the whole batch)
   updates the table; a group without any valid reward is ignored (neither selected nor
   unselected). A prompt drawn twice in one batch adds two history entries, in batch order.
2. ``draw`` is a pure function of the table and (seed, step, round): the same ids on every rank and
   after a resume, whatever was drawn before (its ``torch.Generator`` is seeded per call).
3. If ``max_passes`` passes accept fewer than ``n`` prompts (nearly all probabilities 0), the rest
   is filled with uniformly drawn unselected rows, so a step never stalls.
4. Categories are read from the ``category_column`` of ``rollout.meta`` as groups are observed
   (rows never observed have weight 1), or given up front with ``bind(..., rows=train_rows)``.
   Calibration runs after steps with ``(step + 1) % calib_every == 0`` on the mean valid reward of
   each category over that period; a category with no reward in the period keeps its weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def step_generator(seed: int, step: int, round_: int, salt: int = 0) -> torch.Generator:
    """A generator keyed by (run seed, step, refill round): a draw never depends on call history."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step * 10_007 + round_ * 101 + salt) % (2**63))


def group_variance(rewards: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """(population variance [B], has-a-valid-reward [B]) of each group's valid rewards."""
    r = torch.where(valid, rewards.double(), 0.0)  # [B,G]
    count = valid.sum(1)  # [B]
    mean = r.sum(1) / count.clamp(min=1)  # [B]
    var = (torch.where(valid, r - mean[:, None], 0.0) ** 2).sum(1) / count.clamp(min=1)  # [B]
    return var, count > 0


def normalize_variances(var: Tensor, flat_value: float = 1.0) -> Tensor:
    """Batch min-max normalisation P_var = (V − min V) / (max V − min V); ``flat_value`` if max = min."""
    lo, hi = var.min(), var.max()  # [], []
    if hi <= lo:
        return torch.full_like(var, flat_value)  # [B]
    return (var - lo) / (hi - lo)  # [B]


def proposal_probs(rewards: Tensor, valid: Tensor | None = None, flat_value: float = 1.0) -> Tensor:
    """P_var [B'] of the groups with at least one valid reward (rewards [B,G], NaN = excluded)."""
    valid = torch.isfinite(rewards) if valid is None else valid.bool() & torch.isfinite(rewards)  # [B,G]
    var, has = group_variance(rewards, valid)  # [B], [B]
    return normalize_variances(var[has], flat_value)  # [B']


def category_weights(mean_rewards: Tensor, lam: float = 1.0, r_floor: float = 1e-3) -> Tensor:
    """Proportional-fairness solution q [c] of max Σ log q − lam·KL(v ‖ q), v ∝ 1/r."""
    inv = 1.0 / mean_rewards.double().clamp(min=r_floor)  # [c]
    v = inv / inv.sum()  # [c]
    return (1.0 + lam * v) / (mean_rewards.numel() + lam)  # [c]


@register("sampling", "cgpo")
@dataclass
class CGPOSampler:
    """Bernoulli prompt sampling from a table of batch-normalised group-reward variances (CGPO, CVPR 2026)."""

    history: int = 3
    bonus: float = 0.0
    init_prob: float = 1.0
    flat_value: float = 1.0
    clip: bool = True
    replace: bool = False
    max_passes: int = 1000
    category_column: str = ""
    lam: float = 1.0
    calib_every: int = 10
    r_floor: float = 1e-3

    max_rounds: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if (
            self.history < 1
            or self.max_passes < 1
            or self.calib_every < 0
            or self.lam < 0
            or not 0 <= self.init_prob <= 1
        ):
            raise ValueError(
                f"cgpo: need history >= 1, max_passes >= 1, calib_every >= 0, lam >= 0, 0 <= init_prob <= 1; got {self}"
            )
        self._n_rows: int | None = None
        self._seed = 0
        self._table: Tensor | None = None  # [N] float64 P_list
        self._hist: dict[int, list[float]] = {}
        self._cat: dict[int, Any] = {}  # row -> category
        self._w: dict[Any, float] = {}  # category -> calibration weight
        self._window: dict[Any, list[float]] = {}  # category -> [reward sum, count] since the last calibration

    def bind(self, n_rows: int, seed: int, rows: list[dict] | None = None) -> None:
        if n_rows < 1:
            raise ValueError("cgpo: the dataset has no rows")
        if self._table is not None and self._table.numel() != n_rows:
            raise ValueError(f"cgpo: resumed state was for {self._table.numel()} rows, the dataset has {n_rows}")
        self._n_rows, self._seed = int(n_rows), int(seed)
        if self._table is None:
            self._table = torch.full((n_rows,), float(self.init_prob), dtype=torch.float64)  # [N]
        if rows is not None and self.category_column:
            self._cat.update(
                {i: row[self.category_column] for i, row in enumerate(rows) if self.category_column in row}
            )

    def _probabilities(self) -> Tensor:
        """[N] acceptance probability min(1, w[cat(p)]·P_list[p]) of every row."""
        if self._table is None:
            raise RuntimeError("cgpo: call bind(n_rows, seed) before draw")
        w = torch.ones_like(self._table)  # [N]
        for row, cat in self._cat.items():
            w[row] = self._w.get(cat, 1.0)
        return (w * self._table).clamp(0.0, 1.0)  # [N]

    def draw(self, n: int, info: StepInfo) -> list[int]:
        prob = self._probabilities()  # [N]
        N = prob.numel()
        if n > N and not self.replace:
            raise ValueError(f"cgpo: cannot draw {n} distinct prompts from {N} rows (set replace=true)")
        g = step_generator(self._seed, info.step, info.round)
        ids: list[int] = []
        taken = set()
        for _ in range(self.max_passes):
            perm = torch.randperm(N, generator=g)  # [N] shuffled prompt list
            u = torch.rand(N, generator=g, dtype=torch.float64)  # [N]
            for i in perm[u < prob[perm]].tolist():  # accepted, in list order
                if self.replace or i not in taken:
                    ids.append(i)
                    taken.add(i)
                    if len(ids) == n:
                        return ids
        rest = [i for i in torch.randperm(N, generator=g).tolist() if self.replace or i not in taken]
        return ids + rest[: n - len(ids)]

    def keep(self, rollout: Rollout) -> Tensor:
        return torch.ones(rollout.shape[0], dtype=torch.bool)  # [B]

    def observe(self, rollout: Rollout, info: StepInfo) -> None:
        if self._table is None or self._n_rows is None:
            raise RuntimeError("cgpo: call bind(n_rows, seed) before observe")
        if rollout.rewards is None:
            raise ValueError("cgpo.observe needs rollout.rewards (a scored batch)")
        r = rollout.rewards.double()  # [B,G]
        valid = rollout.group_valid.bool() & torch.isfinite(r)  # [B,G]
        var, has = group_variance(r, valid)  # [B], [B]
        rows = rollout.prompt_index.tolist()
        p_var = normalize_variances(var[has], self.flat_value).tolist() if bool(has.any()) else []  # [B']
        scored = [p for p, h in zip(rows, has.tolist()) if h]
        for row, value in zip(scored, p_var):
            self._hist[row] = (self._hist.get(row, []) + [value])[-self.history :]
        in_batch = torch.zeros(self._n_rows, dtype=torch.bool)  # [N]
        in_batch[rows] = True  # a group without valid rewards is neither selected nor unselected
        bonus = self.bonus if self.bonus > 0 else 1.0 / self._n_rows
        table = torch.where(in_batch, self._table, self._table + bonus)  # [N]
        for row in set(scored):
            table[row] = sum(self._hist[row]) / len(self._hist[row])
        self._table = table.clamp(0.0, 1.0) if self.clip else table  # [N]
        if self.category_column:
            self._observe_categories(rollout, r, valid, info)

    def _observe_categories(self, rollout: Rollout, r: Tensor, valid: Tensor, info: StepInfo) -> None:
        if len(rollout.meta) != r.shape[0]:
            raise ValueError(
                f"cgpo: category_column={self.category_column!r} needs rollout.meta (dataset columns) for every group"
            )
        for b, (row, meta) in enumerate(zip(rollout.prompt_index.tolist(), rollout.meta)):
            if self.category_column not in meta:
                raise KeyError(
                    f"cgpo: category_column {self.category_column!r} is not a dataset column (have {sorted(meta)})"
                )
            cat = self._cat[row] = meta[self.category_column]
            acc = self._window.setdefault(cat, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + float(r[b][valid[b]].sum()), acc[1] + float(valid[b].sum())
        if self.calib_every and (info.step + 1) % self.calib_every == 0:
            cats = [c for c, (_, count) in self._window.items() if count > 0]
            if cats:
                q = category_weights(
                    torch.tensor([self._window[c][0] / self._window[c][1] for c in cats]), self.lam, self.r_floor
                )  # [c]
                self._w.update({c: float(len(cats) * q_i) for c, q_i in zip(cats, q.tolist())})
            self._window = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_rows": self._n_rows,
            "seed": self._seed,
            "table": None if self._table is None else self._table.tolist(),
            "history": [[p, h] for p, h in sorted(self._hist.items())],
            "categories": [[p, c] for p, c in sorted(self._cat.items())],
            "weights": [[c, w] for c, w in self._w.items()],
            "window": [[c, s] for c, s in self._window.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        table = state["table"]
        if self._n_rows is not None and table is not None and len(table) != self._n_rows:
            raise ValueError(f"cgpo: state is for {len(table)} rows, bound to {self._n_rows}")
        self._table = None if table is None else torch.tensor(table, dtype=torch.float64)  # [N]
        self._n_rows = self._n_rows or state["n_rows"]
        self._seed = int(state["seed"])
        self._hist = {int(p): list(h) for p, h in state["history"]}
        self._cat = {int(p): c for p, c in state["categories"]}
        self._w = {c: float(w) for c, w in state["weights"]}
        self._window = {c: list(s) for c, s in state["window"]}
