"""Toy-Flow-2D before/after Flash-GRPO: writes docs/flow_toy_before_after.png.

Trains with the groupwise trainer and the shipped recipe (``groupwise train flash_grpo``: one SDE
step per row at an index shared by the group, the rectification weight, GRPO advantages, PPO-clip
with ε = 1e-3, AdamW lr 5e-3, 16 prompts × 16 rows a step) for ``--steps`` steps. Samples are drawn
with the ODE sampler on a fixed seed set (32 prompts × 16 rows), before and after.

    python bench/flow_toy_plot.py [--steps 200] [--out docs/flow_toy_before_after.png]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from groupwise.modalities.flow import FlowPolicy  # noqa: E402
from groupwise.modalities.flow_toy import mixture_centres, region_reward  # noqa: E402
from groupwise.types import Request, StepInfo  # noqa: E402

COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]


def ode_samples(policy: FlowPolicy) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(x_final [32,16,2], labels [32], mean region reward) of the ODE sampler on the fixed seed set."""
    ode = FlowPolicy(sde="none", hidden=policy.config["hidden"])
    ode.load_state_dict(policy.state_dict())
    ro = ode.generate(
        [Request(key=1000 + k, n=16, prompt=k % 4) for k in range(32)],
        {},
        StepInfo(step=0, seed=1234, max_new_tokens=0),
    )
    labels = torch.tensor([p[0] for p in ro.prompt_ids])  # [32]
    return ro.extras["x_final"], labels, region_reward(ro.extras["x_final"], labels).mean().item()


def train(steps: int, out: str):
    """The trainer on the ``flash_grpo`` recipe; (its policy, the per-step mean training reward)."""
    import json

    from groupwise.config import load_config
    from groupwise.run import Run

    cfg, _ = load_config("flash_grpo", [f"train.steps={steps}", f'out="{out}"', "eval.size=0"])
    run = Run.from_config(cfg)
    before = FlowPolicy(**cfg.model.params)
    before.load_state_dict(run.trainer.policy.state_dict())
    run.train()
    curve = [json.loads(line)["reward_mean"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return before, run.trainer.policy, curve


def panel(ax, x: torch.Tensor, labels: torch.Tensor, title: str) -> None:
    for k, (cx, cy) in enumerate(mixture_centres(4).tolist()):
        ax.add_patch(plt.Circle((cx, cy), 0.75, fill=False, color=COLOURS[k], lw=1.5))
        pts = x[labels == k].reshape(-1, 2)
        ax.scatter(pts[:, 0], pts[:, 1], s=6, color=COLOURS[k], alpha=0.6, label=f"label {k}")
    ax.set_xlim(-4, 4), ax.set_ylim(-4, 4), ax.set_aspect("equal"), ax.set_title(title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "flow_toy_before_after.png")
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    import tempfile

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        before, after, curve = train(args.steps, out)
    seconds = time.perf_counter() - start
    x0, labels, r0 = ode_samples(before)
    x1, _, r1 = ode_samples(after)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.3))
    panel(axes[0], x0, labels, f"before: region reward {r0:.3f}")
    panel(axes[1], x1, labels, f"after {args.steps} Flash-GRPO steps: {r1:.3f}")
    axes[1].legend(loc="upper right", fontsize=7, markerscale=2)
    axes[2].plot(curve), axes[2].set_xlabel("step"), axes[2].set_ylabel("mean training reward (one SDE step)")
    axes[2].set_title(f"groupwise train flash_grpo ({seconds:.1f} s, 1 thread)")
    fig.suptitle("Toy-Flow-2D: samples of each label should land in its circle (ODE sampler, fixed seeds)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"region reward {r0:.3f} -> {r1:.3f} after {args.steps} steps ({seconds:.1f} s); wrote {args.out}")


if __name__ == "__main__":
    main()
