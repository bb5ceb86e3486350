"""GAGPO's toy, both arms: writes src/groupwise/papers/23_gagpo/keydoor_curves.png.

Reads the run folders of claim 23-gagpo (``groupwise claims [--confirm] 23-gagpo``: one folder per
arm and seed, ``metrics.jsonl`` each) and draws, per arm, three curves against the training step:
the held-out closed-loop greedy success (the claim's metric, every ``eval.every`` steps), the
sampled share of episodes that picked the key (``env/key``: P(pick key) under sampling, the first
move the spec's behavioural test names) and the sampled share that opened the door
(``env/opened``: the training success rate). Thin lines are seeds, thick lines their mean.

    python bench/gagpo_plot.py [--runs runs/claims/confirm/23-gagpo] [--out PNG]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ARMS = {"gagpo_grpo": ("trajectory-level GRPO", "tab:blue"), "gagpo": ("GAGPO", "tab:orange")}
PANELS = [
    ("eval_accuracy", "held-out closed-loop greedy success"),
    ("env/key", "sampled P(pick key), first move"),
    ("env/opened", "sampled success (door opened)"),
]


def curves(folder: Path, key: str) -> list[tuple[list[int], list[float]]]:
    """Per seed folder: (steps, values) of ``key`` in its metrics.jsonl (eval rows: step + 1, as the claims count)."""
    out = []
    for seed in sorted(folder.glob("seed*")):
        rows = [json.loads(line) for line in (seed / "metrics.jsonl").read_text().splitlines() if line.strip()]
        pts = [(r["step"] + (1 if key == "eval_accuracy" else 0), r[key]) for r in rows if r.get(key) is not None]
        if key == "eval_accuracy":
            summary = json.loads((seed / "summary.json").read_text()) if (seed / "summary.json").exists() else {}
            pts = sorted({int(s): a for s, a in summary.get("evals", [])}.items()) or pts
        if pts:
            out.append(([p[0] for p in pts], [p[1] for p in pts]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="GAGPO keydoor curves of claim 23-gagpo, both arms")
    parser.add_argument("--runs", default="runs/claims/confirm/23-gagpo")
    parser.add_argument("--out", default="src/groupwise/papers/23_gagpo/keydoor_curves.png")
    ns = parser.parse_args()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, PANELS):
        for arm, (label, colour) in ARMS.items():
            seeds = curves(Path(ns.runs) / arm, key)
            for steps, vals in seeds:
                ax.plot(steps, vals, color=colour, alpha=0.25, lw=0.8)
            if seeds:
                n = min(len(v) for _, v in seeds)
                mean = [sum(v[i] for _, v in seeds) / len(seeds) for i in range(n)]
                ax.plot(seeds[0][0][:n], mean, color=colour, lw=2.2, label=f"{label} (mean of {len(seeds)} seeds)")
        if key == "eval_accuracy":
            ax.axhline(0.9, color="grey", ls="--", lw=0.8, label="target 0.9")
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"keydoor ('pick 1-4=' -> 2, then 'door c key=' -> c): {ns.runs}")
    fig.tight_layout()
    fig.savefig(ns.out, dpi=110)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
