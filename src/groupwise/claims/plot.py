"""``curves.png`` of a comparison: reward curves (mean over seeds, min–max band) and held-out accuracy."""

from __future__ import annotations

import textwrap
from pathlib import Path


def _smooth(ys: list[float], k: int) -> list[float]:
    return [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]


def _by_step(series: list[list[tuple[int, float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean, min and max over seeds at every step that some seed has."""
    table: dict[int, list[float]] = {}
    for points in series:
        for step, y in points:
            if y is not None:
                table.setdefault(step, []).append(y)
    steps = sorted(table)
    return (
        steps,
        [sum(table[s]) / len(table[s]) for s in steps],
        [min(table[s]) for s in steps],
        [max(table[s]) for s in steps],
    )


def plot_curves(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    colours = plt.get_cmap("tab10").colors
    longest = max(
        (len(r["metrics"]["curve"]) for c in result["configs"] for r in c["runs"] if r["status"] == "ok"), default=0
    )
    k = max(1, longest // 25)
    for i, config in enumerate(result["configs"]):
        colour = colours[i % len(colours)]
        ok = [r for r in config["runs"] if r["status"] == "ok"]
        label = f"{config['label']} (n={len(ok)})"
        if not ok:
            ax_r.plot([], [], color=colour, label=f"{config['label']} (no finished run)")
            continue
        curves = []
        for run in ok:
            points = [(s, y) for s, y in run["metrics"]["curve"] if y is not None]
            curves.append(list(zip([s for s, _ in points], _smooth([y for _, y in points], k))))
        steps, mean, low, high = _by_step(curves)
        ax_r.plot(steps, mean, color=colour, label=label)
        ax_r.fill_between(steps, low, high, color=colour, alpha=0.18, linewidth=0)
        steps, mean, low, high = _by_step([run["metrics"]["evals"] for run in ok])
        yerr = [
            [max(0.0, m - lo) for m, lo in zip(mean, low)],
            [max(0.0, hi - m) for m, hi in zip(mean, high)],
        ]  # equal seeds: the float mean may pass them by 1 ulp
        ax_a.errorbar(steps, mean, yerr=yerr, color=colour, marker="o", capsize=3, label=label)
    ax_r.set_title(
        f"batch reward ({k}-step moving average), mean over seeds, band min–max"
        if k > 1
        else "batch reward, mean over seeds, band min–max",
        fontsize=9,
    )
    ax_a.set_title("held-out greedy accuracy, mean over seeds, bars min–max", fontsize=9)
    if result.get("target") is not None:
        ax_a.axhline(result["target"], color="grey", linestyle=":", linewidth=1, label=f"target {result['target']}")
    for ax, name in ((ax_r, "reward"), (ax_a, "accuracy")):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(textwrap.fill(result.get("title", ""), 150), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
