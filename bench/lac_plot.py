"""LAC's toy before/after: writes src/groupwise/papers/10_lac_latent_flow_grpo/binding_before_after.png.

Trains with the groupwise trainer and the shipped recipe (``groupwise train lac``: stage 1 ``lac_align``,
then ``--steps`` GRPO steps on the latent actions and the SDE steps) and, beside it, the claim
``10-lac-align``'s baseline (the same recipe with ``phases=[]``: GRPO from a random planner). Samples are
drawn with the training sampler (planner latents ~ π_φ, then the SDE; its own noise) on a fixed seed set,
64 rows for each of the two orders (0, 1) and (1, 0) of one bag: the generator sees the same bag label for
both, so only the planner's latents can tell it which mode comes first. Each panel's title gives the
deployed (greedy) ``binding_acc`` over all 12 ordered pairs (``binding.greedy_binding``) and the mean
sampled reward of the two shown pairs.

    python bench/lac_plot.py [--steps 30] [--seed 0] [--out PNG]
"""

from __future__ import annotations

import argparse
import importlib
import io
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Circle  # noqa: E402
from PIL import Image  # noqa: E402

from groupwise.build import build  # noqa: E402
from groupwise.config import load_config  # noqa: E402
from groupwise.phases import load_output  # noqa: E402
from groupwise.run import Run  # noqa: E402
from groupwise.trainer import Trainer  # noqa: E402
from groupwise.types import Request, StepInfo  # noqa: E402

binding = importlib.import_module("groupwise.papers.10_lac_latent_flow_grpo.binding")  # a digit-led folder

SHOWN = [(0, 1), (1, 0)]  # one bag, both orders
ROWS = 64  # samples per shown pair


def train(out: Path, steps: int, seed: int, overrides: list[str]) -> tuple[Trainer, dict, dict]:
    """The trainer after its run, and the policy's state at init and after its phases (``lac_align``)."""
    cfg, _ = load_config("lac", [f'out="{out}"', f"train.steps={steps}", f"seed={seed}", *overrides])
    trainer = Trainer(build(cfg))
    init = trainer.policy.state_dict()
    Run(trainer).train()
    aligned_file = out / "phases" / "lac_align.pt"
    aligned = load_output(aligned_file)["policy"] if aligned_file.exists() else init
    return trainer, init, aligned


def samples(policy, state: dict) -> tuple[dict, dict[str, float]]:
    """({pair: x [ROWS,4]}, greedy_binding) of ``policy`` loaded with ``state`` (training sampler, fixed seeds)."""
    policy.load_state_dict(state)
    policy.eval()
    labels = [binding.PAIRS.index(p) for p in SHOWN]
    ro = policy.generate([Request(key=3000 + y, n=ROWS, prompt=[y]) for y in labels], {}, StepInfo(0, 4321, 0))
    x = ro.extras["x_final"]  # [2,ROWS,4]
    reward = binding.binding_score(x, torch.tensor(labels)[:, None].expand(-1, ROWS)).mean().item()
    return {p: x[k] for k, p in enumerate(SHOWN)}, {**binding.greedy_binding(policy), "reward": reward}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="src/groupwise/papers/10_lac_latent_flow_grpo/binding_before_after.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lac, init, aligned = train(Path(tmp) / "lac", args.steps, args.seed, [])
        rl_only, _, _ = train(Path(tmp) / "rl_only", args.steps, args.seed, ["phases=[]"])
        columns = [
            ("init (random planner)", lac.policy, init),
            ("after lac_align (stage 1)", lac.policy, aligned),
            (f"lac_align + {args.steps} GRPO steps", lac.policy, lac.policy.state_dict()),
            (f"{args.steps} GRPO steps, no lac_align", rl_only.policy, rl_only.policy.state_dict()),
        ]
        drawn = [(title, *samples(policy, state)) for title, policy, state in columns]
    mu = binding.mode_centres().float()  # [4,2]
    fig, axes = plt.subplots(2, 4, figsize=(14, 7.2), squeeze=False)
    for col, (title, xs, measured) in enumerate(drawn):
        for row, pair in enumerate(SHOWN):
            ax, x = axes[row, col], xs[pair]
            for m in range(binding.N_MODES):
                ax.add_patch(Circle((float(mu[m, 0]), float(mu[m, 1])), 0.75, fill=False, color="grey", lw=1))
                # the mode's name just outside its circle, clear of the samples
                ax.annotate(f"μ{m}", (1.55 * mu[m]).tolist(), ha="center", va="center", color="grey", fontsize=9)
            # a faint segment per sample joins its first point to its second
            for p1, p2 in zip(x[:, :2], x[:, 2:]):
                ax.plot([p1[0], p2[0]], [p1[1], p2[1]], color="lightgrey", lw=0.5, zorder=0)
            ax.scatter(x[:, 0], x[:, 1], s=8, alpha=0.7, color="tab:blue", label="first point p1")
            ax.scatter(x[:, 2], x[:, 3], s=8, alpha=0.7, color="tab:orange", label="second point p2")
            ax.set_xlim(-3.5, 3.5)
            ax.set_ylim(-3.5, 3.5)
            ax.set_aspect("equal")
            ax.grid(alpha=0.2)
            ax.tick_params(labelsize=7)
            if col == 0:
                ax.set_ylabel(f"prompt: ordered pair {pair}", fontsize=10)
        axes[0, col].set_title(
            f"{title}\ngreedy binding_acc {measured['binding_acc']:.2f} (12 pairs), "
            f"donor_follow {measured['donor_follow']:.2f}\nmean sampled reward (shown pairs) {measured['reward']:.2f}",
            fontsize=9,
        )
    axes[0, 0].legend(loc="lower left", fontsize=7)
    fig.suptitle(
        "LAC binding toy: samples for (0, 1) and (1, 0), one bag {0, 1} to the generator "
        f"(training sampler, {ROWS} rows each, seed {args.seed}); bound = p1 in μ_i's circle and p2 in μ_j's",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))  # room for the suptitle
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=80)
    # a 64-colour palette keeps the file small (the brief's ~150 kB) with no visible loss on flat scatter plots
    Image.open(buffer).convert("RGB").quantize(colors=64).save(args.out, optimize=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
