"""Flow-OPD's toy before/after: writes src/groupwise/papers/45_flow_opd/samples_before_after.png.

Runs the shipped pipelines through the groupwise trainer (``groupwise pipeline flow_opd`` and
``groupwise pipeline flow_grpo_multi``, one shared ``base`` stage) and draws, for every model of the
method, samples of the 8-label flow toy ``flow2d_multi``: the base (flow matching on the 8-mode
mixture), teacher A and teacher B (Flow-GRPO on one task each), the teachers' parameter average (the
student before distillation, phase ``average_init``), the student after its Flow-OPD steps, and
multi-task Flow-GRPO from the base at as many RL steps (the claims' baseline). Samples are the
policy's own SDE draws (8 steps, a = 0.7) on a fixed seed set, 64 per label. Label k and label k + 4
share a colour (dots: task A, labels 0–3; crosses: task B, 4–7): both are rewarded at mode k (task A:
its own mode; task B: the mode opposite its direction), the circle of that colour. Each title gives
the fraction of the drawn samples inside their row's rewarded circle, per task.

    python bench/flow_opd_plot.py [--seed 0] [--out PNG]
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Circle  # noqa: E402

from groupwise.modalities.flow import FlowPolicy  # noqa: E402
from groupwise.modalities.flow_toy import mixture_centres  # noqa: E402
from groupwise.phases import load_output  # noqa: E402
from groupwise.pipeline import run_pipeline  # noqa: E402
from groupwise.types import Request, StepInfo  # noqa: E402

multi_task = importlib.import_module("groupwise.papers.45_flow_opd.multi_task")
COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
PER_LABEL = 64


def policy_of(state: dict) -> FlowPolicy:
    policy = FlowPolicy(**state["config"])
    policy.load_state_dict(state)
    return policy


def final(folder: Path) -> dict:
    return torch.load(folder / "final" / FlowPolicy.policy_file, map_location="cpu", weights_only=False)


def samples(state: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """(x_final [8,64,2] of the policy's own SDE draws, the fraction in the rewarded circle per task)."""
    policy = policy_of(state)
    reqs = [Request(key=3000 + k, n=PER_LABEL, prompt=k) for k in range(multi_task.N_LABELS)]
    x = policy.generate(reqs, {}, StepInfo(0, 4321, 0)).extras["x_final"]  # [8,64,2]
    labels = torch.arange(multi_task.N_LABELS).view(-1, 1).expand(-1, PER_LABEL)  # [8,64]
    tasks = [multi_task.task_of(k) for k in range(multi_task.N_LABELS)]
    hits = multi_task.multi_task_reward(x, labels, tasks, "by_task", 0.75, 2.0)  # [8,64]
    return x, {"A": hits[:4].mean().item(), "B": hits[4:].mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="src/groupwise/papers/45_flow_opd/samples_before_after.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stages = Path(tmp) / "stages"  # the base stage is shared by both pipelines (same config)
        opd = run_pipeline("flow_opd", Path(tmp) / "opd", args.seed, stage_root=stages)
        multi = run_pipeline("flow_grpo_multi", Path(tmp) / "multi", args.seed, stage_root=stages)
        folders = {s["name"]: Path(s["folder"]) for s in opd["stages"] + multi["stages"]}
        steps = {s["name"]: s["steps"] for s in opd["stages"] + multi["stages"]}
        panels = {
            "base (flow matching)": final(folders["base"]),
            f"teacher A (Flow-GRPO, {steps['teacher_a']} steps)": final(folders["teacher_a"]),
            f"teacher B (Flow-GRPO, {steps['teacher_b']} steps)": final(folders["teacher_b"]),
            "teachers' average (student at step 0)": load_output(folders["student"] / "phases" / "average_init.pt")[
                "policy"
            ],
            f"student (Flow-OPD, {steps['student']} steps)": final(folders["student"]),
            f"multi-task Flow-GRPO ({steps['multi']} steps)": final(folders["multi"]),
        }
    fig, axes = plt.subplots(2, 3, figsize=(11, 7.9))
    centres = mixture_centres(multi_task.N_LABELS, 2.0)  # [8,2]
    for ax, (title, state) in zip(axes.flat, panels.items()):
        x, acc = samples(state)
        for j in range(multi_task.N_LABELS):  # every mode of the mixture, grey; the rewarded ones coloured below
            ax.add_patch(
                Circle((centres[j, 0].item(), centres[j, 1].item()), 0.75, fill=False, color="0.8", lw=1, ls="--")
            )
        for k in range(4):
            ax.add_patch(
                Circle((centres[k, 0].item(), centres[k, 1].item()), 0.75, fill=False, color=COLOURS[k], lw=1.5)
            )
            ax.scatter(x[k, :, 0], x[k, :, 1], s=8, alpha=0.6, color=COLOURS[k], label=f"label {k} (A)")
            ax.scatter(x[k + 4, :, 0], x[k + 4, :, 1], s=14, alpha=0.7, marker="x", color=COLOURS[k], lw=0.9)
        ax.set_title(f"{title}\nin the rewarded circle: A {acc['A']:.2f}, B {acc['B']:.2f}", fontsize=9)
        ax.set_xlim(-3.2, 3.2)
        ax.set_ylim(-3.2, 3.2)
        ax.set_aspect("equal")
        ax.grid(alpha=0.2)
    axes[0, 0].legend(loc="lower left", fontsize=7)
    fig.suptitle(
        f"Flow-OPD toy (flow2d_multi), seed {args.seed}: 64 SDE samples per label; dots task A (label k), "
        "crosses task B (label k+4), both rewarded in circle k",
        fontsize=10,
    )
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.04, top=0.89, wspace=0.15, hspace=0.32)  # room for titles
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=60)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
