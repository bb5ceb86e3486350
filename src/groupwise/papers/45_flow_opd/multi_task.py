"""``flow2d_multi``: Flow-OPD's two-task flow toy (spec 45's small-scale analogue, design note §3 "45 Flow-OPD").

"Flow-OPD: On-Policy Distillation for Flow Matching Models", arXiv 2605.08063; code read:
https://github.com/CostaliyA/Flow-OPD (its tasks are GenEval, OCR, PickScore, DeQA on SD3.5-M; the
toy below is [INFERRED], built to have two rewards that pull one shared network two ways).

**Change vs GRPO**: none to the algorithm; a non-text task and its reward. A row is a label k of 8
(the prompt) and a task, the dataset column ``task``: labels 0–3 are task ``A``, 4–7 task ``B``. Its
demonstration ``target`` (for the base model's flow-matching fit, phase ``sft``) is a point of the
8-Gaussian mixture drawn whatever the label, so the fitted base samples the whole mixture for every
label (the "pretrained" model knows the modes, not the tasks) and the MAR anchor is that mixture.

**Math** (μ_j = ring·(cos 2πj/8, sin 2πj/8); x the row's sample ``x_final``)::

    task A (k in 0..3): r_A = 1[‖x − μ_k‖ <= radius]            its own mode
    task B (k in 4..7): r_B = 1[‖x − μ_(k+4 mod 8)‖ <= radius]  the mode opposite its label's direction
    by_task: r = r_task(row)          sum: r = 1[‖x − μ_k‖ <= radius] + 1[‖x − μ_(k+4 mod 8)‖ <= radius]

Task B sends label k to the mode whose own label (k − 4) belongs to task A: the two tasks ask the
shared net for different maps from label to mode (the toy's "different geometry"). Under the base
model about 1/8 of a label's samples land in any one mode, so both rewards start near 0.125.

**Defaults** (the toy's; all [INFERRED]): ``ring = 2``, ``radius = 0.75`` (as ``flow_region``),
``spread = 0.2`` (each mixture component's std), 1024 train rows, 128 held-out rows (another seed).
``flow2d_multi_a`` / ``flow2d_multi_b`` hold only task A's / task B's rows (a teacher's data).

**Notes**

1. ``by_task`` is a rollout scorer reading ``x_final`` [B,G,2], the row's label (``row_labels``) and
   the group's ``meta["task"]``; invalid rows score 0.
2. ``mode = "sum"`` is the summed-rewards form of multi-task RL (the spec's seesaw test): every row
   is paid for either task's mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.modalities.flow_sde import row_labels
from groupwise.modalities.flow_toy import mixture_centres
from groupwise.registry import register
from groupwise.tasks import Task, register_task
from groupwise.types import Rollout, StepInfo

N_LABELS = 8
TASKS = ("A", "B")


def task_of(label: int) -> str:
    """``"A"`` for labels 0–3, ``"B"`` for 4–7."""
    return TASKS[int(label) // 4]


def target_mode(label: Tensor, task: str) -> Tensor:
    """The mode index each label is rewarded for under ``task``: k (A) or k + 4 mod 8 (B)."""
    return label if task == "A" else (label + 4) % N_LABELS


def multi_rows(n: int, seed: int, tasks: tuple[str, ...] = TASKS, ring: float = 2.0, spread: float = 0.2) -> list[dict]:
    """``n`` rows ``{"prompt": k, "task": "A" | "B", "target": [x, y]}`` (seeded): labels uniform over
    the ``tasks``' labels, targets from the 8-Gaussian mixture independent of the label."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([k for k in range(N_LABELS) if task_of(k) in tasks])  # [L]
    labels = pool[torch.randint(len(pool), (n,), generator=g)]  # [n]
    modes = torch.randint(N_LABELS, (n,), generator=g)  # [n]
    points = mixture_centres(N_LABELS, ring)[modes] + spread * torch.randn(n, 2, generator=g)  # [n,2]
    return [
        {"prompt": int(k), "task": task_of(int(k)), "target": [float(x), float(y)]}
        for k, (x, y) in zip(labels.tolist(), points.tolist(), strict=True)
    ]


def _split(tasks: tuple[str, ...]):
    def rows(split: str, n: int, seed: int) -> list[dict]:
        size = n or (1024 if split == "train" else 128)
        return multi_rows(size, seed if split == "train" else seed + 10_007, tasks)

    return rows


register_task(
    Task(
        "flow2d_multi",
        "2-D flow toy with two tasks (column `task`): labels 0-3 land on their own mode (A), 4-7 on the opposite "
        "one (B); demonstrations from the 8-mode mixture (Flow-OPD's toy, spec 45)",
        _split(TASKS),
        reward="by_task",
    )
)
register_task(Task("flow2d_multi_a", "flow2d_multi's task A rows only (a teacher's data)", _split(("A",)), "by_task"))
register_task(Task("flow2d_multi_b", "flow2d_multi's task B rows only (a teacher's data)", _split(("B",)), "by_task"))


def multi_task_reward(x_final: Tensor, labels: Tensor, tasks: list[str], mode: str, radius: float, ring: float):
    """[B,G] float32 (module docstring) for ``x_final`` [B,G,2], ``labels`` [B,G] and one task per group."""
    centres = mixture_centres(N_LABELS, ring)  # [8,2]

    def hit(modes: Tensor) -> Tensor:  # [B,G] 1 within radius of each row's mode
        return (torch.linalg.vector_norm(x_final.float() - centres[modes], dim=-1) <= radius).float()

    if mode == "sum":
        return hit(target_mode(labels, "A")) + hit(target_mode(labels, "B"))  # [B,G]
    per_task = torch.stack([target_mode(labels[b], t) for b, t in enumerate(tasks)]) if tasks else labels  # [B,G]
    return hit(per_task)  # [B,G]


@register("reward", "by_task")
@dataclass
class ByTaskReward:
    """Each row scored by its own task's reward (``mode = "by_task"``) or by the sum of both (``"sum"``)."""

    mode: str = "by_task"  # by_task | sum (the summed-rewards form of multi-task RL)
    radius: float = 0.75  # [INFERRED] as flow_region
    ring: float = 2.0  # [INFERRED] as flow_region
    weight: float = 1.0

    needs = ()
    modality = "flow"  # reads the flow policy's x_final

    def __post_init__(self) -> None:
        if self.mode not in ("by_task", "sum") or self.radius <= 0:
            raise ValueError(f"by_task: mode must be 'by_task' or 'sum' ({self.mode!r}), radius > 0 ({self.radius})")

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        points = rollout.extras.get("x_final")
        if points is None or points.shape[-1] != 2:
            raise ValueError("by_task needs the row extra 'x_final' [B,G,2] of the flow policy's 2-D samples")
        tasks = [str(m.get("task", "")) for m in rollout.meta]
        bad = sorted({t for t in tasks if t not in TASKS})
        if bad and self.mode == "by_task":
            raise ValueError(f"by_task: rows need a dataset column `task` of {TASKS}; got {bad}")
        labels = row_labels(rollout)  # [B,G]
        reward = multi_task_reward(points, labels, tasks, self.mode, self.radius, self.ring)  # [B,G]
        return torch.where(rollout.group_valid.bool(), reward, torch.zeros(()))  # [B,G]
