"""DEVIS-GRPO's toy before/after: writes src/groupwise/papers/11_devis_grpo/views_before_after.png.

Two policies of one seed, trained by the groupwise trainer: after the small-view fit (recipe ``devis`` with
``train.steps = 0``) and after ``--steps`` GRPO steps on ADEVIS chains (the recipe). Each row of the figure
is one held-out cloud of ``cloud_views``: its input (grey), the exact view at Θ = 120° (black circles), the
single shot at Θ (blue crosses) and the greedy chain of ``--links`` uniform links (red dots, its earlier
links' outputs faded), each panel titled with the two rewards (−Chamfer − 0.5·outlier share).

    python bench/devis_plot.py [--steps 40] [--seed 0] [--links 5] [--out PNG]
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
from groupwise.run import Run  # noqa: E402
from groupwise.trainer import Trainer  # noqa: E402
from groupwise.types import Request, StepInfo  # noqa: E402

views = importlib.import_module("groupwise.papers.11_devis_grpo.cloud_views")
CLOUDS = 4


def trained(out: Path, steps: int, seed: int):
    cfg, _ = load_config("devis", [f'out="{out}"', f"train.steps={steps}", f"seed={seed}", "eval.size=0"])
    trainer = Trainer(build(cfg))
    Run(trainer).train()
    return trainer.policy


def chain(policy, clouds: torch.Tensor, links: int) -> list[torch.Tensor]:
    """The greedy outputs [S,12] of every link of a uniform chain from ``clouds`` [S,12] to Θ."""
    delta, x, outs = math.radians(views.TARGET_DEG) / links, clouds, []
    for j in range(links):
        prompts = [c + [math.cos(delta), math.sin(delta)] for c in x.tolist()]
        batch = policy.generate(
            [Request(key=i, n=1, offset=j, prompt=p) for i, p in enumerate(prompts)],
            {"greedy": True},
            StepInfo(step=-1, seed=4321, max_new_tokens=0),
        )
        x = batch.extras["x_final"][:, 0].double()  # [S,12]
        outs.append(x)
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--links", type=int, default=5)
    ap.add_argument("--out", default="src/groupwise/papers/11_devis_grpo/views_before_after.png")
    args = ap.parse_args()
    rows = views.cloud_rows(CLOUDS, seed=args.seed + 10_007, max_deg=None)  # held-out clouds (the task's eval seed)
    obs = torch.tensor([r["prompt"] for r in rows], dtype=torch.float64)  # [S,14]
    with tempfile.TemporaryDirectory() as tmp:
        policies = {
            "after the fit": trained(Path(tmp) / "fit", 0, args.seed),
            f"after {args.steps} GRPO steps": trained(Path(tmp) / "grpo", args.steps, args.seed),
        }
    fig, axes = plt.subplots(CLOUDS, 2, figsize=(7, 3.2 * CLOUDS))
    for col, (name, policy) in enumerate(policies.items()):
        single = chain(policy, obs[:, :12], 1)[-1]  # [S,12]
        links = chain(policy, obs[:, :12], args.links)
        for s in range(CLOUDS):
            ax = axes[s, col]
            exact = views.rotate(obs[s, :12], math.radians(views.TARGET_DEG)).view(6, 2)
            ax.scatter(*obs[s, :12].view(6, 2).T, c="0.75", s=20, label="input")
            ax.scatter(*exact.T, facecolors="none", edgecolors="k", s=60, label="exact view")
            for j, x in enumerate(links[:-1]):
                ax.scatter(*x[s].view(6, 2).T, c="r", s=8, alpha=0.15 + 0.1 * j)
            ax.scatter(*links[-1][s].view(6, 2).T, c="r", s=20, label=f"{args.links}-link chain")
            ax.scatter(*single[s].view(6, 2).T, c="b", marker="x", s=25, label="single shot")
            r_chain = float(views.view_reward(links[-1][s], obs[s]))
            r_single = float(views.view_reward(single[s], obs[s]))
            ax.set_title(f"{name}\nchain {r_chain:.2f} · single {r_single:.2f}", fontsize=8)
            ax.set_aspect("equal")
            ax.set_xlim(-2, 2)
            ax.set_ylim(-2, 2)
            ax.tick_params(labelsize=6)
    axes[0, 0].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
