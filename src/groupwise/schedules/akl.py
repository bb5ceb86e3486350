"""FG-ExPO / EXPO Accuracy-conditioned KL scaling (AKL): the KL coefficient follows batch accuracy.

"FG-ExPO: Frontier-Guided Exploration-Prioritized Policy Optimization via Adaptive KL and Gaussian
Curriculum", Lin, Gong, Tang, Li, Wang, Ma, Huang, Tang, Lu (OPPO), 2026.
https://arxiv.org/abs/2605.11403 — also "EXPO: Exploration-Prioritized Policy Optimization via
Adaptive KL Regulation and Gaussian Curriculum Sampling", https://arxiv.org/abs/2605.09923.
Spec 36 (Part A = abstract 36, Part B = abstract 43). Only the abstracts were available.

**Change vs GRPO**: GRPO's KL coefficient β is a constant; AKL sets it every step from a smooth,
increasing function of the batch's mean accuracy — a loose leash while the model is weak (explore),
a tight one once it does well. A schedule/controller (stage ``schedule``) for any coefficient::

    objective.terms = ["ppo_clip", { name = "kl", coef = { schedule = "akl", beta_max = 0.08 } }]

**Math** (``acc`` = mean over the step's valid rollouts of reward, or of reward ≥ threshold)::

    acc_s   = acc                                      (ema_decay = 0)
    acc_s   ← ema_decay·acc_s + (1 − ema_decay)·acc    (first step: acc_s = acc)
    sigmoid: beta = beta_min + (beta_max − beta_min)·σ(k·(acc_s − center))
    tanh:    beta = beta_min + (beta_max − beta_min)·(1 + tanh(k·(acc_s − center)))/2
    power:   beta = beta_min + (beta_max − beta_min)·clip(acc_s, 0, 1)^gamma

**Defaults**

- increasing, smooth, nonlinear in batch mean accuracy [ABSTRACT].
- ``shape = "sigmoid"``, ``k = 10``, ``center = 0.5``, ``beta_min = 0`` [INFERRED] both parts.
- ``beta_max = 0.04`` [INFERRED] Part B: β_base, GRPO's β = 0.04; Part A: 2·β_0 (0.08 with
  β_0 = 0.04, the recipe's choice).
- ``tanh``, ``power`` shapes, ``gamma = 2`` [INFERRED] Part B's variants (γ not given).
- ``ema_decay = 0.0`` [INFERRED] Part A's option: 0.9.
- ``threshold = None`` [INFERRED] binary rewards are accuracies.

**Notes**

1. The trainer calls the schedule once per step on the whole scored batch, before advantages;
   ``start()`` is the value before any step (β at ``acc = center``) and, after a resume, the last β.
2. ``tanh`` is the sigmoid with slope 2k ((1 + tanh x)/2 = σ(2x)); it is kept as Part B names it.
3. A batch without any valid reward leaves β (and the EMA) unchanged.
4. ``state_dict`` holds the EMA and the last β, so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo

SHAPES = ("sigmoid", "tanh", "power")


def akl_beta(
    mean_acc: float,
    beta_min: float = 0.0,
    beta_max: float = 0.04,
    k: float = 10.0,
    center: float = 0.5,
    shape: str = "sigmoid",
    gamma: float = 2.0,
) -> float:
    """β(acc): beta_min + (beta_max − beta_min)·f(acc) with f a sigmoid, tanh or power curve in [0, 1]."""
    if shape == "sigmoid":
        f = 1.0 / (1.0 + math.exp(-k * (mean_acc - center)))
    elif shape == "tanh":
        f = (1.0 + math.tanh(k * (mean_acc - center))) / 2.0
    elif shape == "power":
        f = min(max(mean_acc, 0.0), 1.0) ** gamma
    else:
        raise ValueError(f"akl: shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    return beta_min + (beta_max - beta_min) * f


def batch_accuracy(rollout: Rollout, threshold: float | None = None) -> float | None:
    """Mean over valid rollouts of the reward (or of reward ≥ threshold); None when none is valid."""
    if rollout.rewards is None:
        raise ValueError("akl needs rollout.rewards (a scored batch)")
    r = rollout.rewards.double()  # [B,G]
    valid = rollout.group_valid.bool() & torch.isfinite(r)  # [B,G]
    if not bool(valid.any()):
        return None
    hits = r if threshold is None else (r >= threshold).double()  # [B,G]
    return float(hits[valid].mean())


@register("schedule", "akl")
@dataclass
class AKLSchedule:
    """KL coefficient = smooth increasing function of batch mean accuracy (FG-ExPO / EXPO AKL, 2026)."""

    beta_min: float = 0.0
    beta_max: float = 0.04
    k: float = 10.0
    center: float = 0.5
    shape: str = "sigmoid"
    gamma: float = 2.0
    ema_decay: float = 0.0
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"akl: shape must be one of {', '.join(SHAPES)}, got {self.shape!r}")
        if not 0 <= self.ema_decay < 1 or self.beta_max < self.beta_min or self.gamma <= 0:
            raise ValueError(f"akl: need 0 <= ema_decay < 1, beta_max >= beta_min, gamma > 0; got {self}")
        self._acc: float | None = None  # smoothed accuracy
        self._beta: float | None = None

    def _beta_at(self, acc: float) -> float:
        return akl_beta(acc, self.beta_min, self.beta_max, self.k, self.center, self.shape, self.gamma)

    def start(self) -> float:
        return self._beta if self._beta is not None else self._beta_at(self.center)

    def __call__(self, info: StepInfo, rollout: Rollout) -> float:
        acc = batch_accuracy(rollout, self.threshold)
        if acc is None:
            return self.start()
        self._acc = acc if self._acc is None else self.ema_decay * self._acc + (1.0 - self.ema_decay) * acc
        self._beta = self._beta_at(self._acc)
        return self._beta

    def state_dict(self) -> dict[str, Any]:
        return {"acc": self._acc, "beta": self._beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._acc, self._beta = state["acc"], state["beta"]
