"""DIAL's toy before/after: writes src/groupwise/papers/26_dial/samples_before_after.png.

Three policies of one seed: after the CFG-dropout fit on one demo per scene (recipe ``dial`` with
``train.steps = 0``), after ``--steps`` steps of multi-intent GRPO (the recipe) and after as many of
single-intent GRPO (``rollout.params.mode = "single"``), all from the same fit. Each is trained by
the groupwise trainer, or read from finished run folders (``--runs DIR`` holding ``fit/``,
``multi/`` and ``single/``, e.g. the claims' exploratory seed-0 folders linked there). Each row
of the figure is one held-out scene: the obstacle (red disc), the goal heading (green arrow), 16
guided candidates (2 per intent, coloured by intent, greedy ODE) and 16 unconditional samples
(black crosses), with the best-of-16 rater score of each set.

    python bench/dial_plot.py [--steps 60] [--seed 0] [--runs DIR] [--out PNG]
"""

from __future__ import annotations

import argparse
import importlib
import math
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from groupwise.build import build  # noqa: E402
from groupwise.config import load_config  # noqa: E402
from groupwise.modalities.flow import FlowPolicy  # noqa: E402
from groupwise.rollout.multi_intent import group_intents  # noqa: E402
from groupwise.run import Run  # noqa: E402
from groupwise.trainer import Trainer  # noqa: E402
from groupwise.types import Request, StepInfo  # noqa: E402

drive2d = importlib.import_module("groupwise.papers.26_dial.drive2d")
SCENES = 4


def trained(out: Path, steps: int, seed: int, overrides: list[str]) -> dict:
    cfg, _ = load_config("dial", [f'out="{out}"', f"train.steps={steps}", f"seed={seed}", "eval.size=0", *overrides])
    trainer = Trainer(build(cfg))
    Run(trainer).train()
    return trainer.policy.state_dict()


def samples(state: dict, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(guided [S,16,2], unconditional [S,16,2]) greedy ODE endpoints on the held-out scenes ``rows``."""
    policy = FlowPolicy(**state["config"], cfg_w=2.0)
    policy.net.load_state_dict(state["net"])
    info = StepInfo(step=-1, seed=4321, max_new_tokens=0)
    guided = policy.generate(
        [Request(key=i, n=16, prompt=r["prompt"], extras={"intent": group_intents(8, 2)}) for i, r in enumerate(rows)],
        {"greedy": True},
        info,
    )
    uncond = policy.generate(
        [Request(key=i, n=16, offset=16, prompt=r["prompt"], extras={"intent": [-1] * 16}) for i, r in enumerate(rows)],
        {"greedy": True},
        info,
    )
    return guided.extras["x_final"], uncond.extras["x_final"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default="")
    parser.add_argument("--out", default="src/groupwise/papers/26_dial/samples_before_after.png")
    args = parser.parse_args()
    if args.runs:
        states = [torch.load(Path(args.runs) / k / "final" / "flow_policy.pt") for k in ("fit", "multi", "single")]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            states = [
                trained(Path(tmp) / "fit", 0, args.seed, []),
                trained(Path(tmp) / "multi", args.steps, args.seed, []),
                trained(Path(tmp) / "single", args.steps, args.seed, ['rollout.params={mode="single"}']),
            ]
    rows = drive2d.scene_rows(SCENES, seed=args.seed + 10_007)  # the first held-out scenes of the seed
    obs = torch.tensor([r["prompt"] for r in rows])  # [S,4]
    titles = [
        "after the fit (1 demo / scene)",
        f"multi-intent GRPO, {args.steps} steps",
        f"single-intent GRPO, {args.steps} steps",
    ]
    fig, axes = plt.subplots(SCENES, 3, figsize=(10.5, 3.4 * SCENES))
    colours = plt.get_cmap("tab10")
    for col, (state, title) in enumerate(zip(states, titles)):
        guided, uncond = samples(state, rows)
        for s in range(SCENES):
            ax = axes[s, col]
            o, g = obs[s, :2], obs[s, 2:]
            ax.add_patch(plt.Circle(o.tolist(), 0.75, color="tab:red", alpha=0.25))
            ax.annotate("", xy=(2.6 * g).tolist(), xytext=(0, 0), arrowprops={"color": "tab:green", "width": 1.5})
            for j, k in enumerate(group_intents(8, 2)):
                ax.scatter(*guided[s, j].tolist(), s=18, color=colours(k), label=f"intent {k}" if j % 2 == 0 else None)
            ax.scatter(uncond[s, :, 0], uncond[s, :, 1], s=22, marker="x", color="black", label="unconditional")
            best_g = drive2d.rater_score(guided[s], obs[s].expand(16, 4)).max().item()
            best_u = drive2d.rater_score(uncond[s], obs[s].expand(16, 4)).max().item()
            ax.set_title(
                f"{title}\nbest of 16: guided {best_g:.2f}, unconditional {best_u:.2f}"
                if s == 0
                else f"best of 16: guided {best_g:.2f}, unconditional {best_u:.2f}",
                fontsize=8,
            )
            ax.set_xlim(-3.2, 3.2)
            ax.set_ylim(-3.2, 3.2)
            ax.set_aspect("equal")
            ax.grid(alpha=0.2)
            ax.plot(
                *(2 * torch.tensor([[math.cos(t), math.sin(t)] for t in torch.linspace(0, 2 * math.pi, 64)]).T),
                lw=0.5,
                color="grey",
            )
    axes[0, 0].legend(loc="lower left", fontsize=6, ncol=2)
    fig.suptitle(
        "DIAL toy: 4 held-out scenes (rows). Red: obstacle; green: goal heading; dots: 2 guided samples per intent; "
        "crosses: unconditional samples",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
