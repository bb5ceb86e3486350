"""GRIP-VLM's toy before/after: writes src/groupwise/papers/22_grip_vlm/accuracy_before_after.png.

Trains with the groupwise trainer and the shipped recipes: ``grip_warmup`` (the ListNet warm-up on
the leave-one-in saliency teacher, no RL) and ``grip_grpo`` (the same warm-up, then GRPO on the frozen
reader's reward), on ``--seeds``. Plots the greedy held-out accuracy of pair queries (each of the two
needed items is useless alone) and single queries at each budget, the unseen ρ = 0.1875 included,
with the accuracy of a uniformly random keep-set (chance) for reference. Bars are seed means, dots
the seeds.

    python bench/grip_vlm_plot.py [--seeds 1000 1001 1002 1003 1004] [--out PNG]
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from groupwise.build import build  # noqa: E402
from groupwise.config import load_config  # noqa: E402
from groupwise.modalities.subset import budget_k  # noqa: E402
from groupwise.run import Run  # noqa: E402
from groupwise.trainer import Trainer  # noqa: E402

K = importlib.import_module("groupwise.papers.22_grip_vlm.keep_items")
ARMS = {"grip_warmup": "warm-up only (ListNet, saliency teacher)", "grip_grpo": "warm-up + GRPO"}
COLOURS = {"grip_warmup": "tab:grey", "grip_grpo": "tab:blue"}


def accuracies(recipe: str, seed: int, folder: Path) -> dict[str, float]:
    cfg, _ = load_config(recipe, [f'out="{folder}"', f"seed={seed}"])
    summary = Run(Trainer(build(cfg))).train()
    return {k.split("/", 1)[1]: v for k, v in summary.items() if k.startswith("accuracy_after/")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1000, 1001, 1002, 1003, 1004])
    default = Path(__file__).resolve().parents[1] / "src/groupwise/papers/22_grip_vlm/accuracy_before_after.png"
    parser.add_argument("--out", default=str(default))
    args = parser.parse_args()
    results = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ARMS:
            for seed in args.seeds:
                results[arm].append(accuracies(arm, seed, Path(tmp) / f"{arm}-{seed}"))
                print(arm, seed, {k: round(v, 3) for k, v in sorted(results[arm][-1].items())})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind in zip(axes, ("pair", "single")):
        for i, rho in enumerate(K.TEST_BUDGETS):
            for j, arm in enumerate(ARMS):
                values = [r[f"{kind}@{rho}"] for r in results[arm]]
                x = i + (j - 0.5) * 0.38
                ax.bar(x, sum(values) / len(values), 0.36, color=COLOURS[arm], label=ARMS[arm] if i == 0 else None)
                ax.scatter([x] * len(values), values, s=10, color="black", zorder=3)
            k = budget_k(K.N_ITEMS, rho)
            ax.hlines(K.chance(k, kind), i - 0.4, i + 0.4, colors="tab:red", linestyles=":", label="random keep-set" if i == 0 else None)
        ax.set_xticks(range(len(K.TEST_BUDGETS)))
        ax.set_xticklabels(
            [f"ρ = {r} (k = {budget_k(K.N_ITEMS, r)}){' unseen' if r not in K.TRAIN_BUDGETS else ''}" for r in K.TEST_BUDGETS]
        )
        ax.set_title(f"{kind} queries" + (" (both items needed, each useless alone)" if kind == "pair" else ""))
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("held-out greedy accuracy (64 rows per bar)")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"GRIP-VLM keep-items toy: 16 items, frozen reader; seeds {args.seeds[0]}..{args.seeds[-1]}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
