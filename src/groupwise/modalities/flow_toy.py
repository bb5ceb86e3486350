"""Toy-Flow-2D reward alignment: land each sample in the region of its label's mixture centre.

The shared toy of specs/README ("2-D flow model (Toy-Flow-2D)"), used by 14 Flash-GRPO and the other
flow specs: a label is the "prompt", a 2-D point the "image", and the reward an indicator of landing
in the mode associated with the label (the README's second reward form).

**Change vs GRPO**: none to the algorithm; a non-text task. Rows are ``{"prompt": label}``; the
reward is a rollout scorer that reads the policy's row extra ``x_final`` [B,G,2] instead of text.

**Math** (``K = n_labels``; label k's centre on a circle of radius ``ring``)::

    μ_k    = ring · (cos(2πk/K), sin(2πk/K))
    reward = 1.0 if ‖x_final − μ_label‖ <= radius else 0.0          # [B,G] float32

    flow_trap (task flow2d_trap; u_k = μ_k / ring, the label's direction):
    reward = 1.0 if ‖x_final + far·u_label‖ <= radius               (the far optimum, opposite side)
             near_reward if ‖x_final − near·u_label‖ <= radius      (the near, easy one)
             0.0 otherwise

**Defaults**

- ``n_labels = 4`` [INFERRED] the toy's number of modes.
- ``ring = 2.0``, ``radius = 0.75`` [INFERRED] the toy's geometry: under N(0, I)
  4.3 % of samples land in a given region (``tests/test_flow.py``), so the reward starts low.
- ``weight = 1.0`` [CODE] TRL ``GRPOConfig.reward_weights = None`` weighs every reward 1.0.
- ``flow_trap``: ``near = 1.0``, ``far = 2.5``, ``radius = 0.5``, ``near_reward = 0.5``
  [INFERRED] E²PO's behavioural test (spec 15: "a narrow optimum reached early"): under N(0, I)
  about 7.3 % of samples land in the near region and 0.6 % in the far one, so a group finds the
  near one first; the far one is worth twice as much.

**Notes**

1. A *rollout scorer* (``score_rollout(rollout, info)``, no ``__call__``), like ``kl_penalty``.
2. Invalid rows (``group_valid`` False) score 0; each row is scored against the label of its own
   context (``rollout.row_contexts()``: the group's prompt ``[label]``, or the row's ``ctx``).
3. A point exactly on the circle of radius ``radius`` counts as inside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.modalities.flow_sde import row_labels
from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def _points_and_labels(rollout: Rollout, name: str) -> Tensor:
    """[B,G] the label of each row's own context (``modalities.flow.row_labels``), after checking that
    the rollout holds 2-D samples ``x_final`` [B,G,2] and that each context is a label ``[label]``
    (any policy that writes ``x_final`` passes the build: one conditioned on observations fails here)."""
    points = rollout.extras.get("x_final")
    if points is None or points.shape[-1] != 2:
        raise ValueError(
            f"{name} needs the row extra 'x_final' [B,G,2] of 2-D samples (written by modalities.flow.FlowPolicy "
            f"with dim = 2), got {None if points is None else tuple(points.shape)}"
        )
    bad = next((c for row in rollout.row_contexts() for c in row if c and not _is_label(c)), None)
    if bad is not None:
        raise ValueError(
            f"{name} reads each row's label, a prompt [label]; got {bad!r}: use a policy conditioned on the label "
            '(model.policy = "flow" with the label condition, "planner" or "unified")'
        )
    return row_labels(rollout)


def _is_label(context: list) -> bool:
    return len(context) == 1 and isinstance(context[0], int) and not isinstance(context[0], bool)


def mixture_rows(n: int, n_labels: int = 4, seed: int = 0) -> list[dict]:
    """``n`` dataset rows ``{"prompt": label}``, labels uniform over ``range(n_labels)`` (seeded)."""
    labels = torch.randint(n_labels, (n,), generator=torch.Generator().manual_seed(seed))  # [n]
    return [{"prompt": int(k)} for k in labels]


def bimodal_rows(n: int, n_labels: int = 4, ring: float = 2.0, spread: float = 0.2, seed: int = 0) -> list[dict]:
    """``n`` demonstration rows ``{"prompt": k, "target": [x, y], "mode": m}`` (seeded): label k's
    points are a 50/50 mixture of the centres μ_k (``mode`` 0) and μ_{k+1 mod K} (``mode`` 1), each
    with isotropic Gaussian scatter of std ``spread`` (task ``flow2d_bimodal``; the reward pays μ_k only)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(n_labels, (n,), generator=g)  # [n]
    modes = torch.randint(2, (n,), generator=g)  # [n]
    points = mixture_centres(n_labels, ring)[(labels + modes) % n_labels] + spread * torch.randn(
        n, 2, generator=g
    )  # [n,2]
    return [
        {"prompt": int(k), "target": [float(x), float(y)], "mode": int(m)}
        for k, m, (x, y) in zip(labels, modes, points.tolist())
    ]


def mixture_centres(n_labels: int = 4, ring: float = 2.0) -> Tensor:
    """[n_labels, 2] float32: centre k at angle 2πk/n_labels on the circle of radius ``ring``."""
    angle = 2 * math.pi * torch.arange(n_labels, dtype=torch.float64) / n_labels  # [K]
    return (ring * torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1)).float()  # [K,2]


def region_reward(
    x_final: Tensor, labels: Tensor, n_labels: int = 4, radius: float = 0.75, ring: float = 2.0
) -> Tensor:
    """[B,G] float32: 1 where ``x_final`` [B,G,2] lies within ``radius`` of its label's centre
    (``labels`` [B], one per group, or [B,G], one per row)."""
    labels = torch.as_tensor(labels, dtype=torch.long)  # [B] or [B,G]
    if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) < n_labels):
        raise ValueError(f"region_reward: labels must lie in [0, {n_labels}), got {labels.tolist()}")
    centre = mixture_centres(n_labels, ring)[labels]  # [B,2] or [B,G,2]
    if centre.dim() == 2:
        centre = centre[:, None, :]  # [B,1,2]
    dist = torch.linalg.vector_norm(x_final.float() - centre, dim=-1)  # [B,G]
    return (dist <= radius).float()  # [B,G]


@register("reward", "flow_region")
@dataclass
class FlowRegionReward:
    """1 if a flow sample lands within ``radius`` of its label's mixture centre (Toy-Flow-2D)."""

    n_labels: int = 4
    radius: float = 0.75
    ring: float = 2.0
    weight: float = 1.0

    needs = ()
    reads_extras = ("x_final",)  # the sample of any policy that writes one (flow, planner, unified)

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        labels = _points_and_labels(rollout, "flow_region")  # [B,G]
        reward = region_reward(rollout.extras["x_final"], labels, self.n_labels, self.radius, self.ring)  # [B,G]
        return torch.where(rollout.group_valid.bool(), reward, torch.zeros(()))  # [B,G]


def trap_reward(
    x_final: Tensor,
    labels: Tensor,
    n_labels: int = 4,
    near: float = 1.0,
    far: float = 2.5,
    radius: float = 0.5,
    near_reward: float = 0.5,
) -> Tensor:
    """[B,G] float32: 1 within ``radius`` of the far optimum (``far`` from the origin, opposite the
    label's direction), else ``near_reward`` within ``radius`` of the near one (``near`` along the
    label's direction), else 0. ``labels`` [B] (one per group) or [B,G] (one per row)."""
    labels = torch.as_tensor(labels, dtype=torch.long)  # [B] or [B,G]
    if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) < n_labels):
        raise ValueError(f"trap_reward: labels must lie in [0, {n_labels}), got {labels.tolist()}")
    unit = mixture_centres(n_labels, 1.0)[labels]  # [B,2] or [B,G,2] the label's direction
    if unit.dim() == 2:
        unit = unit[:, None, :]  # [B,1,2]
    x = x_final.float()  # [B,G,2]
    in_far = torch.linalg.vector_norm(x + far * unit, dim=-1) <= radius  # [B,G]
    in_near = torch.linalg.vector_norm(x - near * unit, dim=-1) <= radius  # [B,G]
    return torch.where(in_far, 1.0, torch.where(in_near, near_reward, 0.0)).float()  # [B,G]


@register("reward", "flow_trap")
@dataclass
class FlowTrapReward:
    """A near, easy optimum worth ``near_reward`` and a far one worth 1 on the opposite side (Toy-Flow-2D; spec 15's
    behavioural test)."""

    n_labels: int = 4
    near: float = 1.0
    far: float = 2.5
    radius: float = 0.5
    near_reward: float = 0.5
    weight: float = 1.0

    needs = ()
    reads_extras = ("x_final",)

    def __post_init__(self) -> None:
        if (
            self.radius <= 0
            or self.near < 0
            or self.far < 0
            or not 0 <= self.near_reward < 1
            or self.near + self.far <= 2 * self.radius
        ):
            raise ValueError(
                f"flow_trap: need radius > 0 ({self.radius}), near, far >= 0 ({self.near}, {self.far}), "
                f"0 <= near_reward < 1 ({self.near_reward}) and disjoint regions (near + far > 2·radius)"
            )

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        labels = _points_and_labels(rollout, "flow_trap")  # [B,G]
        reward = trap_reward(
            rollout.extras["x_final"], labels, self.n_labels, self.near, self.far, self.radius, self.near_reward
        )  # [B,G]
        return torch.where(rollout.group_valid.bool(), reward, torch.zeros(()))  # [B,G]
