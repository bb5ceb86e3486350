"""``traj2d``: KVPO's toy "video" (spec 21's CPU implementation, design note §3 "21 KVPO"): a trajectory
of 2-D frames that must reach a target smoothly.

KVPO: arXiv 2605.14278 (spec 21). Everything here is [INFERRED]: the paper generates video with a
causal video model and scores it with HPSv3-style rewards on the perturbed chunk (local) and the
whole post-fork video (global); the toy keeps that split.

**Change vs GRPO**: none to the algorithm; a non-text task and its two reward columns.

**Math** (a prompt: 3 history frames h₀, h₁, h₂ and a target τ; the generated frames f₀..f₅; the
sequence s = h₀, h₁, h₂, f₀, …, f₅)::

    demonstration:  s_{i} = continue_curve(s_{i−3}, s_{i−2}, s_{i−1})   (keeps the turn and the speed)
    jerk_i       = | ‖s_i − s_{i−1}‖ − ‖s_{i−1} − s_{i−2}‖ |               (0 on a demonstration: the speed is kept)
    traj_global  = −‖f₅ − τ‖ − smooth · mean_{i = 0..5} jerk(f_i)
    traj_local   = (‖f_{a−1} − τ‖ − ‖f_b − τ‖) − smooth · mean_{i = a..b} jerk(f_i)     a, b = 2, 4

A change of curve (another turn) is not penalised, a change of speed is: routing the cache changes the
storyline, and the reward prefers the storylines that reach the target without a jolt.

The history: h₁ uniform in [−1, 1]², h₂ − h₁ of heading uniform and speed U(0.3, 0.5), h₁ − h₀
turned by U(−0.8, 0.8) rad from it and of length U(0.2, 1.6) (the dynamics read only its direction,
so a cache whose oldest slot holds an older frame, a longer chord, is a history the generator has
seen); τ = the demonstration's last frame + N(0, 0.5²) per coordinate. The dynamics depend on the
three last frames, so a cache of other frames (KV routing) makes the generator continue another curve.

**Defaults** (all [INFERRED]: the toy's)

- ``smooth = 1`` (both rewards); ``traj_local``'s region ``first = 2``, ``last = 4`` (the window, frames
  3–4 of 6 in 1-based terms, and the frame after it, where the cache is clean again).

**Notes**

1. Rows: ``prompt`` (8 numbers) and ``target`` (the 6 demonstration frames, 12 numbers; the ``sft``
   phase fits on the task's own train rows). 4096 train rows,
   256 held-out rows (seed + 10 007).
2. The rewards read the row extra ``frames`` [B,G,6,2] and each row's own context; invalid rows score 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.tasks import Task, register_task
from groupwise.types import Rollout, StepInfo

FRAMES = 6
HISTORY = 3
TURN = 1.5  # the largest turn between the history's two segments (rad)
FIRST = (0.2, 2.0)  # the range of the history's first segment length, |h1 − h0|


def continue_curve(f0: Tensor, f1: Tensor, f2: Tensor) -> Tensor:
    """[...,2] the frame after f0, f1, f2 [...,2] that keeps their turn: v' = R(φ)·v with v = f2 − f1,
    u = f1 − f0 and φ = angle(v) − angle(u) (the toy's demonstration dynamics; the speed |v| is kept)."""
    u, v = f1 - f0, f2 - f1  # [...,2]
    phi = torch.atan2(v[..., 1], v[..., 0]) - torch.atan2(u[..., 1], u[..., 0])  # [...]
    c, s = torch.cos(phi), torch.sin(phi)
    return f2 + torch.stack([c * v[..., 0] - s * v[..., 1], s * v[..., 0] + c * v[..., 1]], dim=-1)


def traj_rows(n: int, seed: int) -> list[dict]:
    """``n`` rows (Math): a history arc, the target, and the demonstration's frames."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, 6, generator=g, dtype=torch.float64)  # [n,6]
    h1 = u[:, :2] * 2 - 1  # [n,2]
    heading, speed, turn = u[:, 2] * 2 * math.pi, 0.3 + 0.2 * u[:, 3], (u[:, 4] * 2 - 1) * TURN
    first = FIRST[0] + (FIRST[1] - FIRST[0]) * u[:, 5]  # [n] |h1 − h0|: the dynamics read only its direction

    def unit(a: Tensor) -> Tensor:
        return torch.stack([torch.cos(a), torch.sin(a)], -1)  # [n,2]

    seq = [h1 - first[:, None] * unit(heading - turn), h1, h1 + speed[:, None] * unit(heading)]
    for _ in range(FRAMES):
        seq.append(continue_curve(seq[-3], seq[-2], seq[-1]))
    seq_t = torch.stack(seq, 1)  # [n,9,2]
    target = seq_t[:, -1] + 0.5 * torch.randn(n, 2, generator=g, dtype=torch.float64)  # [n,2]
    prompt = torch.cat([seq_t[:, :HISTORY].flatten(1), target], 1)  # [n,8]
    return [
        {"prompt": [round(v, 6) for v in p], "target": [round(v, 6) for v in t]}
        for p, t in zip(prompt.tolist(), seq_t[:, HISTORY:].flatten(1).tolist())
    ]


def speed_changes(seq: Tensor) -> Tensor:
    """[...,F] the jerk of every generated frame of sequences [...,3+F,2] (Math)."""
    speed = (seq[..., 1:, :] - seq[..., :-1, :]).norm(dim=-1)  # [...,2+F]
    return (speed[..., 2:] - speed[..., 1:-1]).abs()  # [...,F]


def _sequences(rollout: Rollout, who: str) -> tuple[Tensor, Tensor]:
    """(sequences [B,G,9,2], targets [B,G,2]) float64 of the rows."""
    frames = rollout.extras.get("frames")
    if frames is None or tuple(frames.shape[2:]) != (FRAMES, 2):
        raise ValueError(
            f"{who} needs the row extra 'frames' [B,G,{FRAMES},2] (model.policy = 'ar_flow' with frames = {FRAMES}), "
            f"got {None if frames is None else tuple(frames.shape)}"
        )
    ctx = rollout.row_contexts()
    if any(len(c) != 2 * (HISTORY + 1) for row in ctx for c in row):
        raise ValueError(f"{who} reads each row's context: 3 history frames and the target (8 numbers, task traj2d)")
    p = torch.tensor(ctx, dtype=torch.float32).double()  # [B,G,8]
    history = p[..., : 2 * HISTORY].unflatten(-1, (HISTORY, 2))  # [B,G,3,2]
    return torch.cat([history, frames.double()], dim=2), p[..., 2 * HISTORY :]


@register("reward", "traj_global")
@dataclass
class TrajGlobal:
    """KVPO toy reward on the whole trajectory: −distance of the last frame to the target − smooth·mean jerk."""

    smooth: float = 1.0  # [INFERRED] weight of the speed-change penalty (the demonstrations keep their speed)
    weight: float = 1.0

    needs = ()
    modality = "ar_flow"

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        seq, target = _sequences(rollout, "traj_global")
        score = -(seq[..., -1, :] - target).norm(dim=-1) - self.smooth * speed_changes(seq).mean(-1)  # [B,G]
        return torch.where(rollout.group_valid.bool(), score, torch.zeros((), dtype=score.dtype)).float()


@register("reward", "traj_local")
@dataclass
class TrajLocal:
    """KVPO toy reward on the perturbed region: progress toward the target over frames a..b − smooth·mean jerk."""

    first: int = 2  # a: the perturbation window's first frame (0-based) [INFERRED] design "frames 3–4"
    last: int = 4  # b: the window's last frame and the one after it, where the cache returns to clean
    smooth: float = 1.0
    weight: float = 1.0

    needs = ()
    modality = "ar_flow"

    def __post_init__(self) -> None:
        if not 1 <= self.first <= self.last < FRAMES:
            raise ValueError(f"traj_local: need 1 <= first <= last < {FRAMES}, got {self.first}, {self.last}")

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        seq, target = _sequences(rollout, "traj_local")
        a, b = HISTORY + self.first, HISTORY + self.last
        progress = (seq[..., a - 1, :] - target).norm(dim=-1) - (seq[..., b, :] - target).norm(dim=-1)  # [B,G]
        dev = speed_changes(seq)[..., self.first : self.last + 1].mean(-1)  # [B,G]
        score = progress - self.smooth * dev
        return torch.where(rollout.group_valid.bool(), score, torch.zeros((), dtype=score.dtype)).float()


def _rows(split: str, n: int, seed: int) -> list[dict]:
    size = n or (4096 if split == "train" else 256)
    return traj_rows(size, seed if split == "train" else seed + 10_007)


register_task(
    Task(
        "traj2d",
        "KVPO's toy video (spec 21): continue a 2-D trajectory of 3 frames for 6 frames, smoothly, to a target",
        _rows,
        reward={"name": "traj_global"},
    )
)
