"""GRIP-VLM's toy before/after: writes src/groupwise/papers/22_grip_vlm/pair_accuracy.png.

Reads the claim's run folders (``groupwise claims 22-grip-vlm --confirm`` writes them under
``runs/claims/confirm/22-grip-vlm/``; without ``--confirm``, the exploratory ones under
``runs/claims/22-grip-vlm/``): the greedy held-out accuracy on pair queries (both items needed, each
useless alone) at each budget (``accuracy_after/pair@RHO``, the claim's ``eval.by = "cell"``), the
unseen ρ = 0.1875 included, after the warm-up alone and after the warm-up and 20 GRPO steps. Bars are
seed means, dots the seeds; the dotted line is a uniformly random keep-set (chance).

    python bench/grip_vlm_plot.py [--runs runs/claims/confirm/22-grip-vlm] [--out PNG]
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from groupwise.modalities.subset import budget_k  # noqa: E402

K = importlib.import_module("groupwise.papers.22_grip_vlm.keep_items")
ROOT = Path(__file__).resolve().parents[1]
ARMS = {"warmup_only": "warm-up only (ListNet on leave-one-in saliency)", "grpo": "warm-up + 20 GRPO steps"}
COLOURS = {"warmup_only": "tab:grey", "grpo": "tab:blue"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default=str(ROOT / "runs/claims/confirm/22-grip-vlm"))
    parser.add_argument("--out", default=str(ROOT / "src/groupwise/papers/22_grip_vlm/pair_accuracy.png"))
    args = parser.parse_args()
    runs = {arm: sorted((Path(args.runs) / arm).glob("seed*/summary.json")) for arm in ARMS}
    if not all(runs.values()):
        raise SystemExit(
            f"no finished runs of both arms under {args.runs}: run `groupwise claims 22-grip-vlm --confirm`"
        )
    summaries = {arm: [json.loads(p.read_text()) for p in paths] for arm, paths in runs.items()}
    seeds = sorted({p.parent.name for paths in runs.values() for p in paths})
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, rho in enumerate(K.TEST_BUDGETS):
        for j, arm in enumerate(ARMS):
            values = [s[f"accuracy_after/pair@{rho}"] for s in summaries[arm]]
            x = i + (j - 0.5) * 0.38
            ax.bar(x, sum(values) / len(values), 0.36, color=COLOURS[arm], label=ARMS[arm] if i == 0 else None)
            ax.scatter([x] * len(values), values, s=10, color="black", zorder=3)
            print(arm, rho, [round(v, 3) for v in values])
        chance = K.chance(budget_k(K.N_ITEMS, rho), "pair")
        ax.hlines(
            chance, i - 0.4, i + 0.4, colors="tab:red", linestyles=":", label="random keep-set" if i == 0 else None
        )
    ax.set_xticks(range(len(K.TEST_BUDGETS)))
    ax.set_xticklabels(
        [
            f"ρ = {r}, k = {budget_k(K.N_ITEMS, r)}{' (unseen)' if r not in K.TRAIN_BUDGETS else ''}"
            for r in K.TEST_BUDGETS
        ]
    )
    ax.set_ylabel("held-out pair-query accuracy (64 rows per bar)")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="center right", fontsize=8)
    ax.set_title(
        f"GRIP-VLM keep-items toy (16 items, frozen reader), seeds {', '.join(s[4:] for s in seeds)}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
