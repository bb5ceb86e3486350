"""CM-GRPO's toy before/after: writes src/groupwise/papers/19_cm_grpo/samples_before_after.png.

Trains with the groupwise trainer and the shipped recipe (``groupwise train cm_grpo``: the
flow-matching fit on bimodal demonstrations, then ``--steps`` CM-GRPO steps on the 4-step
consistency kernel) and, beside it, the claim's baseline (Flow-GRPO on the 10-step Euler SDE, the
same fit). Samples are drawn with the 4-step consistency sampler (the deployed one) on a fixed seed
set (4 labels × 64 rows; stochastic: the kernel's own noise), after the fit and after each arm's
RL. Label k's reward region is the circle around μ_k; the demonstrations also put mass at μ_(k+1).

    python bench/cm_grpo_plot.py [--steps 20] [--seed 0] [--out PNG]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from groupwise.build import build  # noqa: E402
from groupwise.config import load_config  # noqa: E402
from groupwise.modalities.flow import FlowPolicy  # noqa: E402
from groupwise.modalities.flow_toy import mixture_centres, region_reward  # noqa: E402
from groupwise.phases import load_output  # noqa: E402
from groupwise.run import Run  # noqa: E402
from groupwise.trainer import Trainer  # noqa: E402
from groupwise.types import Request, StepInfo  # noqa: E402

COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
BASELINE = [
    'model.params={steps=10, sampler="euler", sde="all", hidden=64, layers=3}',
    'objective.terms=[{name="ppo_clip", eps_low=1e-3, eps_high=1e-3}]',
]


def consistency_samples(state: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(x_final [4,64,2], labels [4], mean reward) of the 4-step consistency sampler (its own noise)."""
    policy = FlowPolicy(steps=4, sampler="consistency", sde="one_shared", sde_window=3)
    policy.load_state_dict(state)
    ro = policy.generate([Request(key=2000 + k, n=64, prompt=k) for k in range(4)], {}, StepInfo(0, 4321, 0))
    labels = torch.arange(4)
    return ro.extras["x_final"], labels, region_reward(ro.extras["x_final"], labels).mean().item()


def train(out: Path, steps: int, seed: int, overrides: list[str]) -> tuple[dict, dict]:
    cfg, _ = load_config("cm_grpo", [f'out="{out}"', f"train.steps={steps}", f"seed={seed}", "eval.size=0", *overrides])
    trainer = Trainer(build(cfg))
    Run(trainer).train()
    fitted = load_output(out / "phases" / "sft.pt")["policy"]
    return fitted, trainer.policy.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="src/groupwise/papers/19_cm_grpo/samples_before_after.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fitted, cm = train(Path(tmp) / "cm", args.steps, args.seed, [])
        _, fg = train(Path(tmp) / "fg", args.steps, args.seed, BASELINE)
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.6))
    titles = [
        "after the flow-matching fit",
        f"CM-GRPO, {args.steps} steps",
        f"Flow-GRPO (Euler SDE), {args.steps} steps",
    ]
    centres = mixture_centres()
    for ax, state, title in zip(axes, (fitted, cm, fg), titles):
        # the same net whatever sampler it trained with (steps is a sampler setting): deploy it with 4 steps
        x, labels, reward = consistency_samples({**state, "config": FlowPolicy(steps=4).config})
        for k in range(4):
            ax.scatter(x[k, :, 0], x[k, :, 1], s=7, alpha=0.6, color=COLOURS[k], label=f"label {k}")
            ax.add_patch(plt.Circle(centres[k].tolist(), 0.75, fill=False, color=COLOURS[k], lw=1.5))
        ax.set_title(f"{title}\nmean reward (own mode) {reward:.2f}", fontsize=10)
        ax.set_xlim(-3.5, 3.5)
        ax.set_ylim(-3.5, 3.5)
        ax.set_aspect("equal")
        ax.grid(alpha=0.2)
    axes[0].legend(loc="lower left", fontsize=8)
    fig.suptitle(
        "4-step consistency samples (circle k: label k's rewarded mode; demonstrations split between μ_k and μ_(k+1))",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))  # room for the suptitle
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
