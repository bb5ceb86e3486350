"""``cloud_views``: DEVIS-GRPO's toy "views" (spec 11's small-scale analogue, design note §3 "11 DEVIS-GRPO").

DEVIS-GRPO / ADEVIS: "dynamic extreme-view video synthesis via accumulative small-view steps",
arXiv 2605.16937 (only the abstract and the start of the introduction were read; no code). The toy
is [INFERRED] (spec 11): a "view" of a scene is a rotation of a 2-D cloud of ``N_POINTS = 6`` points
(D = 12 numbers, x then y of each point, point-major); the generator (the flow policy with
``condition = "vector"``, ``obs_dim = 14``, ``dim = 12``) reads ``[cloud (12), cos Δ, sin Δ]`` and
should output the cloud rotated by Δ about the origin. It is fitted (``sft`` on ``cloud_views_fit``)
only on small rotations |Δ| ≤ ``FIT_MAX_DEG = 30``°; the RL task ``cloud_views`` asks for Θ = 120°.

**Change vs GRPO**: none to the algorithm; a non-text task and its reward.

**Math** (P the generated cloud, Q = R_Θ·input the exact view; n = 6 points each)::

    cloud   = template_k (6 points on a shape, scale 1) + cloud_noise·ε, k uniform of N_TEMPLATES
    chamfer(P, Q) = ½ (mean_i min_j ‖p_i − q_j‖ + mean_j min_i ‖q_j − p_i‖)       (Euclidean, not squared)
    outliers(P, Q) = share of the p_i farther than outlier_radius from every q_j
    chamfer_view  = −chamfer(P, Q) − outlier_weight · outliers(P, Q)      (0 = the exact view: the maximum)

**Defaults** (the toy's; all [INFERRED]: the paper's reward mixes pixel-, feature- and trajectory-level
consistency with an image-quality score, none of which a 2-D cloud has)

- ``N_TEMPLATES = 3`` shapes (a hexagon, a line with a hook, a triangle with midpoints), ``cloud_noise = 0.05``.
- ``outlier_radius = 0.5``, ``outlier_weight = 0.5``: the "quality" term (the spec's λ·outlier fraction).
- 2048 train rows, 256 held-out rows (seed + 10 007); the fit task draws Δ uniform in [−30°, 30°].

**Notes**

1. The reward reads each row's own context (``Rollout.row_contexts()``): the chain's input cloud and
   (cos Θ, sin Θ) (the ``adevis`` strategy keeps the dataset row's prompt as every row's context),
   and the row extra ``x_final`` [B,G,12]; invalid rows score 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.tasks import Task, register_task
from groupwise.types import Rollout, StepInfo

N_POINTS = 6
DIM = 2 * N_POINTS  # the flow policy's sample dimension
OBS_DIM = DIM + 2  # [cloud, cos Δ, sin Δ]
FIT_MAX_DEG = 30.0  # the generator sees only rotations this small
TARGET_DEG = 120.0  # Θ of the RL task
N_TEMPLATES = 3

_TEMPLATES = torch.tensor(
    [
        [[math.cos(a), math.sin(a)] for a in (2 * math.pi * k / 6 for k in range(6))],  # a hexagon
        [[-1.0, 0.0], [-0.5, 0.0], [0.0, 0.0], [0.5, 0.0], [1.0, 0.0], [1.0, 0.5]],  # a line with a hook
        [[0.0, 1.0], [-0.87, -0.5], [0.87, -0.5], [-0.43, 0.25], [0.43, 0.25], [0.0, -0.5]],  # a triangle
    ],
    dtype=torch.float64,
)  # [K,6,2]


def rotate(cloud: Tensor, angle: Tensor | float) -> Tensor:
    """[...,12] float64: clouds [...,12] (x, y per point) rotated by ``angle`` radians ([...] or a float)."""
    pts = cloud.double().reshape(*cloud.shape[:-1], N_POINTS, 2)  # [...,6,2]
    a = torch.as_tensor(angle, dtype=torch.float64)[..., None]  # [...,1]
    x, y = pts[..., 0], pts[..., 1]  # [...,6]
    out = torch.stack([a.cos() * x - a.sin() * y, a.sin() * x + a.cos() * y], dim=-1)  # [...,6,2]
    return out.reshape(cloud.shape)


def chamfer(p: Tensor, q: Tensor) -> Tensor:
    """[...] float64: the symmetric Chamfer distance (module Math) of clouds p, q [...,12]."""
    a = p.double().reshape(*p.shape[:-1], N_POINTS, 1, 2)  # [...,6,1,2]
    b = q.double().reshape(*q.shape[:-1], 1, N_POINTS, 2)  # [...,1,6,2]
    d = torch.linalg.vector_norm(a - b, dim=-1)  # [...,6,6] ‖p_i − q_j‖
    return 0.5 * (d.min(-1).values.mean(-1) + d.min(-2).values.mean(-1))


def outlier_fraction(p: Tensor, q: Tensor, radius: float) -> Tensor:
    """[...] float64: the share of p's points farther than ``radius`` from every point of q."""
    a = p.double().reshape(*p.shape[:-1], N_POINTS, 1, 2)  # [...,6,1,2]
    b = q.double().reshape(*q.shape[:-1], 1, N_POINTS, 2)  # [...,1,6,2]
    nearest = torch.linalg.vector_norm(a - b, dim=-1).min(-1).values  # [...,6]
    return (nearest > radius).double().mean(-1)


def cloud_rows(n: int, seed: int, max_deg: float | None, cloud_noise: float = 0.05) -> list[dict]:
    """``n`` rows ``{"prompt": [cloud, cos Δ, sin Δ], "target": rotated cloud}`` (seeded): Δ uniform in
    [−max_deg, max_deg] degrees (the fit task), or Δ = Θ = 120° when ``max_deg`` is None (the RL task)."""
    g = torch.Generator().manual_seed(seed)
    shape = torch.randint(N_TEMPLATES, (n,), generator=g)  # [n]
    noise = torch.randn(n, N_POINTS, 2, generator=g, dtype=torch.float64)  # [n,6,2]
    cloud = (_TEMPLATES[shape] + cloud_noise * noise).reshape(n, DIM)  # [n,12]
    if max_deg is None:
        delta = torch.full((n,), math.radians(TARGET_DEG), dtype=torch.float64)  # [n]
    else:
        delta = math.radians(max_deg) * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1)  # [n]
    target = rotate(cloud, delta)  # [n,12]
    return [
        {"prompt": [round(v, 6) for v in c] + [round(math.cos(d), 6), round(math.sin(d), 6)], "target": t}
        for c, d, t in zip(cloud.tolist(), delta.tolist(), target.tolist())
    ]


def view_reward(x: Tensor, obs: Tensor, outlier_radius: float = 0.5, outlier_weight: float = 0.5) -> Tensor:
    """[...] float64: ``chamfer_view`` of generated clouds x [...,12] for observations obs [...,14]
    ([input cloud, cos Θ, sin Θ]): the reference is the input rotated by Θ (module Math)."""
    theta = torch.atan2(obs[..., DIM + 1].double(), obs[..., DIM].double())  # [...]
    ref = rotate(obs[..., :DIM], theta)  # [...,12]
    return -chamfer(x, ref) - outlier_weight * outlier_fraction(x, ref, outlier_radius)


@register("reward", "chamfer_view")
@dataclass
class ChamferView:
    """ADEVIS toy reward: −Chamfer to the exact view minus a weighted outlier share (consistency + quality)."""

    outlier_radius: float = 0.5  # [INFERRED] a point this far from every reference point is an outlier
    outlier_weight: float = 0.5  # [INFERRED] λ of the "quality" term (spec 11's toy)
    weight: float = 1.0

    needs = ()
    reads_extras = ("x_final",)  # and the row's observation (checked when scoring)

    def __post_init__(self) -> None:
        if self.outlier_radius <= 0 or self.outlier_weight < 0:
            raise ValueError(
                f"chamfer_view: need outlier_radius > 0 ({self.outlier_radius}) and outlier_weight >= 0 "
                f"({self.outlier_weight})"
            )

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        x = rollout.extras.get("x_final")
        if x is None or x.shape[-1] != DIM:
            raise ValueError(
                f"chamfer_view needs the row extra 'x_final' [B,G,{DIM}] (a flow policy with dim = {DIM}), got "
                f"{None if x is None else tuple(x.shape)}"
            )
        contexts = rollout.row_contexts()  # [B][G] [input cloud, cos Θ, sin Θ]
        if any(len(c) != OBS_DIM for row in contexts for c in row):
            raise ValueError(
                f"chamfer_view reads each row's context, [input cloud ({DIM}), cos Θ, sin Θ] = {OBS_DIM} numbers "
                f'(a flow policy with condition = "vector", obs_dim = {OBS_DIM}, on task cloud_views)'
            )
        obs = torch.tensor(contexts, dtype=torch.float64)  # [B,G,14]
        score = view_reward(x, obs, self.outlier_radius, self.outlier_weight)  # [B,G]
        return torch.where(rollout.group_valid.bool(), score, torch.zeros((), dtype=score.dtype)).float()


def _rows(max_deg: float | None):
    def rows(split: str, n: int, seed: int) -> list[dict]:
        size = n or (2048 if split == "train" else 256)
        return cloud_rows(size, seed if split == "train" else seed + 10_007, max_deg)

    return rows


register_task(
    Task(
        "cloud_views",
        f"DEVIS-GRPO's toy views: rotate a 6-point cloud by Θ = {TARGET_DEG:g}° (spec 11); reward −Chamfer",
        _rows(None),
        reward="chamfer_view",
    )
)
register_task(
    Task(
        "cloud_views_fit",
        f"DEVIS-GRPO's toy fit data: 6-point clouds rotated by |Δ| ≤ {FIT_MAX_DEG:g}° (spec 11; the sft phase's task)",
        _rows(FIT_MAX_DEG),
        reward="chamfer_view",
    )
)
