"""``drive2d``: DIAL's toy driving scene (spec 26's small-scale analogue, design note §3 "26 DIAL").

"Driving Intents Amplify Planning-Oriented Reinforcement Learning", arXiv 2605.12625 (Li Auto /
Tsinghua / CUHK), project page https://mind-omni.github.io/projects/dial/index.html. No code was
found; everything below is the toy [INFERRED], built to show the paper's two effects: one demo per
scene teaches each intent's maneuver but not which one a rater prefers, and preference RL on
unconditional samples collapses onto one maneuver.

**Change vs GRPO**: none to the algorithm; a non-text task and its reward. The scene (ego at the
origin) is an observation of 4 numbers, ``[o_x, o_y, g_x, g_y]``: an obstacle at
``o = obstacle_ring·(cos α, sin α)`` and a goal direction ``g = (cos γ, sin γ)``, α and γ uniform.
An action is a 2-D endpoint x (the flow policy's ``x_final``, a displacement from the ego). Intent
k of ``N_INTENTS = 8`` is the maneuver toward heading 2πk/8, ending ``reach`` away. The train rows
are demonstrations, ONE per scene, of a uniformly random intent c (so the demo's maneuver is
independent of the scene): ``target = reach·(cos 2πc/8, sin 2πc/8) + demo_noise·ε``, with
``intent`` = the rule-derived label :func:`intent_of` of that target (DIAL derives intents from the
demo trajectory by rules).

**Math** (reward ``drive_rater``, a rollout scorer; x the row's endpoint, (o, γ) its scene)::

    intent_of(x) = round(atan2(x_y, x_x) / (2π/8)) mod 8          (the heading sector)
    heading  = exp(−wrap(θ_x − γ)² / (2·heading_tol²))          θ_x = atan2(x_y, x_x), wrap into (−π, π]
    progress = exp(−(‖x‖ − reach)² / (2·reach_tol²))
    score    = heading · progress − collision · 1[‖x − o‖ < obstacle_radius]

so the best maneuver heads to the goal unless the obstacle stands there, in [−collision, 1]. The
nearest intent heading is up to π/8 = 0.39 rad off the goal, where ``heading`` is 0.15: the best
of the 8 maneuvers leaves room that only bending a maneuver toward the scene's goal fills.

**Defaults** (the toy's; all [INFERRED])

- ``reach = 2``, ``demo_noise = 0.1``, ``obstacle_ring = 2`` [INFERRED] the obstacle sits on the
  maneuvers' ring: a maneuver toward it collides.
- ``obstacle_radius = 0.75``, ``reach_tol = 0.5``, ``collision = 1`` [INFERRED] the toy.
- ``heading_tol = 0.2`` rad [INFERRED] the pilot: with an earlier (1 + cos)/2 heading term the
  best of 16 guided samples scored 0.96 after the fit, leaving no room for RL.
- 2048 train scenes, 256 held-out ones (another seed) [INFERRED] the toy.

**Notes**

1. The rater reads each row's own scene (``rollout.row_contexts()``), so a row scored in another
   group than its prompt's is scored against its own observation; invalid rows score 0.
2. The policy must be the flow toy with ``condition = "vector"``, ``obs_dim = 4`` and ``dim = 2``
   (recipe ``dial``); the rater refuses anything else with a message naming what it read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.tasks import Task, register_task
from groupwise.types import Rollout, StepInfo

N_INTENTS = 8
OBS_DIM = 4


def intent_heading(k: Tensor | int) -> Tensor:
    """[...,2] float64: the unit heading of intent k (angle 2πk/8)."""
    angle = 2 * math.pi * torch.as_tensor(k, dtype=torch.float64) / N_INTENTS
    return torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1)


def intent_of(x: Tensor) -> Tensor:
    """[...] int64: the rule-derived intent of endpoints x [...,2]: the heading sector (width 2π/8,
    centred on the intents' headings) its angle falls in."""
    angle = torch.atan2(x[..., 1].double(), x[..., 0].double())  # [...] in (−π, π]
    return torch.round(angle / (2 * math.pi / N_INTENTS)).long() % N_INTENTS


def scene_rows(n: int, seed: int, reach: float = 2.0, demo_noise: float = 0.1, ring: float = 2.0) -> list[dict]:
    """``n`` rows ``{"prompt": [o_x, o_y, g_x, g_y], "target": [x, y], "intent": c}`` (seeded): a scene
    and its single demonstration (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    alpha = 2 * math.pi * torch.rand(n, generator=g, dtype=torch.float64)  # [n] obstacle angle
    gamma = 2 * math.pi * torch.rand(n, generator=g, dtype=torch.float64)  # [n] goal angle
    demo = torch.randint(N_INTENTS, (n,), generator=g)  # [n] the demo's intent, independent of the scene
    noise = torch.randn(n, 2, generator=g, dtype=torch.float64)  # [n,2]
    obs = torch.stack([ring * alpha.cos(), ring * alpha.sin(), gamma.cos(), gamma.sin()], dim=-1)  # [n,4]
    target = reach * intent_heading(demo) + demo_noise * noise  # [n,2]
    return [
        {"prompt": [round(v, 6) for v in o], "target": t, "intent": int(c)}
        for o, t, c in zip(obs.tolist(), target.tolist(), intent_of(target).tolist())
    ]


def rater_score(
    x: Tensor,
    obs: Tensor,
    reach: float = 2.0,
    reach_tol: float = 0.5,
    obstacle_radius: float = 0.75,
    collision: float = 1.0,
    heading_tol: float = 0.2,
) -> Tensor:
    """[...] float32: the rater's score of endpoints x [...,2] in scenes obs [...,4] (module docstring)."""
    x, obs = x.double(), obs.double()
    goal = torch.atan2(obs[..., 3], obs[..., 2])  # [...]
    off = torch.remainder(torch.atan2(x[..., 1], x[..., 0]) - goal + math.pi, 2 * math.pi) - math.pi  # [...]
    heading = torch.exp(-(off**2) / (2 * heading_tol**2))  # [...]
    progress = torch.exp(-((torch.linalg.vector_norm(x, dim=-1) - reach) ** 2) / (2 * reach_tol**2))  # [...]
    hit = torch.linalg.vector_norm(x - obs[..., :2], dim=-1) < obstacle_radius  # [...]
    return (heading * progress - collision * hit.double()).float()


@register("reward", "drive_rater")
@dataclass
class DriveRater:
    """DIAL's toy preference rater: head toward the scene's goal, at the maneuver's reach, clear of the obstacle."""

    reach: float = 2.0  # [INFERRED] the toy's maneuver length
    reach_tol: float = 0.5  # [INFERRED] how far from the reach an endpoint still progresses
    obstacle_radius: float = 0.75  # [INFERRED] the collision disc around the obstacle
    collision: float = 1.0  # [INFERRED] the penalty of an endpoint inside it
    heading_tol: float = 0.2  # [INFERRED] rad: how sharply the rater prefers the goal heading (the pilot)
    weight: float = 1.0

    needs = ()
    reads_extras = ("x_final",)  # and the row's observation (checked when scoring)

    def __post_init__(self) -> None:
        if (
            self.reach <= 0
            or self.reach_tol <= 0
            or self.heading_tol <= 0
            or self.obstacle_radius < 0
            or self.collision < 0
        ):
            raise ValueError(
                f"drive_rater: need reach > 0 ({self.reach}), reach_tol > 0 ({self.reach_tol}), "
                f"heading_tol > 0 ({self.heading_tol}), obstacle_radius >= 0 ({self.obstacle_radius}) and "
                f"collision >= 0 ({self.collision})"
            )

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        x = rollout.extras.get("x_final")
        if x is None or x.shape[-1] != 2:
            raise ValueError(
                "drive_rater needs the row extra 'x_final' [B,G,2] (a flow policy with dim = 2), got "
                f"{None if x is None else tuple(x.shape)}"
            )
        contexts = rollout.row_contexts()  # [B][G] each row's own scene
        if any(len(c) != OBS_DIM for row in contexts for c in row):
            raise ValueError(
                f"drive_rater reads each row's scene, an observation of {OBS_DIM} numbers [o_x, o_y, g_x, g_y] "
                '(a flow policy with condition = "vector", obs_dim = 4, on task drive2d)'
            )
        obs = torch.tensor(contexts, dtype=torch.float64)  # [B,G,4]
        score = rater_score(
            x, obs, self.reach, self.reach_tol, self.obstacle_radius, self.collision, self.heading_tol
        )  # [B,G]
        return torch.where(rollout.group_valid.bool(), score, torch.zeros(()))  # [B,G]


def _rows(split: str, n: int, seed: int) -> list[dict]:
    size = n or (2048 if split == "train" else 256)
    return scene_rows(size, seed if split == "train" else seed + 10_007)


register_task(
    Task(
        "drive2d",
        "DIAL's toy driving scene: one demo per scene of a random 8-heading maneuver; a rater prefers the scene's "
        "goal heading clear of the obstacle (spec 26)",
        _rows,
        reward="drive_rater",
    )
)
