"""FG-ExPO / EXPO Gaussian Curriculum Sampling (GCS): draw questions near 50 % accuracy more often.

"FG-ExPO: Frontier-Guided Exploration-Prioritized Policy Optimization via Adaptive KL and Gaussian
Curriculum", Lin, Gong, Tang, Li, Wang, Ma, Huang, Tang, Lu (OPPO), 2026.
https://arxiv.org/abs/2605.11403 — also "EXPO: Exploration-Prioritized Policy Optimization via
Adaptive KL Regulation and Gaussian Curriculum Sampling", https://arxiv.org/abs/2605.09923.
Spec 36 (Part A = abstract 36, Part B = abstract 43). Only the abstracts were available.

**Change vs GRPO**: instead of uniform epochs, every step draws its questions with probability
proportional to a Gaussian of each question's current accuracy estimate centred at ``mu``, so
training concentrates on the model's learning frontier (groups with both right and wrong answers).
The KL half of the method is the ``akl`` schedule (``schedules/akl.py``).

**Math** (``p_hat[q]`` = accuracy estimate of question q, ``unseen`` until first observed)::

    w[q] = exp(−(p_hat[q] − mu)² / (2 sigma²))
    P[q] = (w[q] + eps) / Σ_q' (w[q'] + eps)
    acc_b = mean of group b's valid rewards (or share ≥ threshold)
    estimate="ema":  p_hat ← decay·p_hat + (1 − decay)·acc_b   (first observation: p_hat = acc_b)
    estimate="mean": p_hat = Σ valid rewards / count, over every observation

**Defaults**

- ``mu = 0.5`` [ABSTRACT] "centered at a moderate accuracy level around 0.5".
- ``sigma = 0.2`` [INFERRED] both reconstructions.
- ``eps = 0.01`` [INFERRED] Part B's floor; Part A: ``eps = 0``.
- ``estimate = "ema"``, ``decay = 0.0`` [INFERRED] Part B: EMA of group accuracy with decay 0
  (= the last observation); Part A: ``estimate = "mean"`` (running mean) or an EMA.
- ``unseen = None`` → ``mu`` [INFERRED] Part B; Part A: 0.5 (the same when mu = 0.5).
- ``replace = False`` [INFERRED] Part B: without replacement within a batch.
- ``threshold = None`` [INFERRED] binary rewards are accuracies; set it for graded rewards.

**Notes**

1. ``observe`` (once per step, after the update, whole batch) updates ``p_hat``; a group
   without any valid reward leaves its question unchanged. A question seen twice in one batch is
   updated twice, in batch order.
2. ``draw`` is a pure function of the table and (seed, step, round) — the same ids on every rank
   and after a resume (``state_dict`` holds the whole table).
3. The own table (not ``info.prompt_stats``) keeps the estimate exactly as the chosen option
   defines it, independent of the shared table's history length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.sampling.cgpo import step_generator
from groupwise.types import Rollout, StepInfo


def gaussian_weights(acc: Tensor, mu: float = 0.5, sigma: float = 0.2) -> Tensor:
    """w = exp(−(acc − mu)² / (2 sigma²)), same shape as ``acc``."""
    return torch.exp(-((acc.double() - mu) ** 2) / (2.0 * sigma**2))  # [Q]


def gaussian_curriculum_probs(acc: Tensor, mu: float = 0.5, sigma: float = 0.2, eps: float = 0.0) -> Tensor:
    """P = (w + eps) / Σ (w + eps) over the questions of ``acc`` [Q]."""
    w = gaussian_weights(acc, mu, sigma) + eps  # [Q]
    return w / w.sum()  # [Q]


@register("sampling", "gcs")
@dataclass
class GaussianCurriculumSampler:
    """Sample questions ∝ a Gaussian of their accuracy centred at 0.5 (FG-ExPO / EXPO GCS, 2026)."""

    mu: float = 0.5
    sigma: float = 0.2
    eps: float = 0.01
    estimate: str = "ema"
    decay: float = 0.0
    unseen: float | None = None
    replace: bool = False
    threshold: float | None = None

    max_rounds: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if self.sigma <= 0 or self.eps < 0 or not 0 <= self.decay < 1 or self.estimate not in ("ema", "mean"):
            raise ValueError(f"gcs: need sigma > 0, eps >= 0, 0 <= decay < 1, estimate in ('ema', 'mean'); got {self}")
        self._n_rows: int | None = None
        self._seed = 0
        self._acc: Tensor | None = None  # [N] float64 p_hat (unseen rows hold the prior)
        self._seen: Tensor | None = None  # [N] bool
        self._sum: Tensor | None = None  # [N] float64 reward sums ("mean")
        self._count: Tensor | None = None  # [N] float64 reward counts ("mean")

    def bind(self, n_rows: int, seed: int) -> None:
        if n_rows < 1:
            raise ValueError("gcs: the dataset has no rows")
        if self._acc is not None and self._acc.numel() != n_rows:
            raise ValueError(f"gcs: resumed state was for {self._acc.numel()} rows, the dataset has {n_rows}")
        self._n_rows, self._seed = int(n_rows), int(seed)
        if self._acc is None:
            prior = self.mu if self.unseen is None else self.unseen
            self._acc = torch.full((n_rows,), float(prior), dtype=torch.float64)  # [N]
            self._seen = torch.zeros(n_rows, dtype=torch.bool)  # [N]
            self._sum, self._count = (
                torch.zeros(n_rows, dtype=torch.float64),
                torch.zeros(n_rows, dtype=torch.float64),
            )  # [N], [N]

    def _accuracy(self) -> Tensor:
        if self._acc is None:
            raise RuntimeError("gcs: call bind(n_rows, seed) before draw")
        return self._acc.clone()  # [N]

    def _probabilities(self) -> Tensor:
        return gaussian_curriculum_probs(self._accuracy(), self.mu, self.sigma, self.eps)  # [N]

    def draw(self, n: int, info: StepInfo) -> list[int]:
        prob = self._probabilities()  # [N]
        if n > prob.numel() and not self.replace:
            raise ValueError(f"gcs: cannot draw {n} distinct questions from {prob.numel()} rows (set replace=true)")
        g = step_generator(self._seed, info.step, info.round, salt=36)
        return torch.multinomial(prob, n, replacement=self.replace, generator=g).tolist()

    def keep(self, rollout: Rollout) -> Tensor:
        return torch.ones(rollout.shape[0], dtype=torch.bool)  # [B]

    def observe(self, rollout: Rollout, info: StepInfo) -> None:
        if self._acc is None:
            raise RuntimeError("gcs: call bind(n_rows, seed) before observe")
        if rollout.rewards is None:
            raise ValueError("gcs.observe needs rollout.rewards (a scored batch)")
        r = rollout.rewards.double()  # [B,G]
        valid = rollout.group_valid.bool() & torch.isfinite(r)  # [B,G]
        hits = r if self.threshold is None else (r >= self.threshold).double()  # [B,G]
        total = torch.where(valid, hits, 0.0).sum(1).tolist()  # [B]
        count = valid.sum(1).tolist()  # [B]
        for q, s, c in zip(rollout.prompt_index.tolist(), total, count):
            if c == 0:
                continue
            self._sum[q] += s
            self._count[q] += c
            if self.estimate == "mean":
                self._acc[q] = self._sum[q] / self._count[q]
            else:
                self._acc[q] = s / c if not self._seen[q] else self.decay * self._acc[q] + (1.0 - self.decay) * (s / c)
            self._seen[q] = True

    def state_dict(self) -> dict[str, Any]:
        keys = ("acc", "seen", "sum", "count")
        tensors = {k: None if getattr(self, f"_{k}") is None else getattr(self, f"_{k}").tolist() for k in keys}
        return {"n_rows": self._n_rows, "seed": self._seed, **tensors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._n_rows is not None and state["acc"] is not None and len(state["acc"]) != self._n_rows:
            raise ValueError(f"gcs: state is for {len(state['acc'])} rows, bound to {self._n_rows}")
        self._n_rows, self._seed = self._n_rows or state["n_rows"], int(state["seed"])
        for key, dtype in (
            ("acc", torch.float64),
            ("seen", torch.bool),
            ("sum", torch.float64),
            ("count", torch.float64),
        ):
            setattr(self, f"_{key}", None if state[key] is None else torch.tensor(state[key], dtype=dtype))
