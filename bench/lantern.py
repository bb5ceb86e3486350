"""Newton's Lantern's toy (paper 37): the precondition check, the train-split pilot, and the PNG.

    python bench/lantern.py precondition            # does the supervised warm start f0 fail? (~1 min)
    python bench/lantern.py pilot [key=value ...] --seeds 0 1 2 [--recipe R]  # read on heavy *train* snapshots
    python bench/lantern.py plot [--seed 0]         # src/groupwise/papers/37_newtons_lantern/iterations.png

``precondition`` fits f0 as the recipe does (the sft phase's fit, 400 steps of 64 rows, AdamW 1e-2)
on demonstrations of several load ranges and measures Newton–Raphson from μ(s) on held-out
snapshots: the share that fails (no convergence within 20 updates, or the low-voltage root) and
the mean update count, beside the flat start (0, 1). The variants are the design's remedies
(``nontext.md`` §3 37: loads closer to the nose, f0 on lighter loads) and two more (a line
reactance the policy does not see, leading loads f0 never saw).
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import tempfile
from pathlib import Path

import torch

from groupwise.build import build
from groupwise.config import load_config
from groupwise.heldout import HeldOut
from groupwise.modalities.gaussian import GaussianPolicy
from groupwise.phases.sft import SFT
from groupwise.run import Run
from groupwise.tasks import TASKS
from groupwise.trainer import Trainer

pf = importlib.import_module("groupwise.papers.37_newtons_lantern.powerflow")
FOLDER = Path(__file__).resolve().parents[1] / "src/groupwise/papers/37_newtons_lantern"

# (label, demo loads, demo power factors, test loads, test power factors, line reactance spread)
VARIANTS = [
    ("recipe: f0 on 10-80 %, test 90-98 %", (0.1, 0.8), (0, 0.4), (0.9, 0.98), (0, 0.4), 0.0),
    ("f0 on 10-98 %, test 90-98 %", (0.1, 0.98), (0, 0.4), (0.9, 0.98), (0, 0.4), 0.0),
    ("f0 on 10-99.9 %, test 97-99.9 %", (0.1, 0.999), (0, 0.4), (0.97, 0.999), (0, 0.4), 0.0),
    ("f0 on 10-50 % (lighter), test 90-98 %", (0.1, 0.5), (0, 0.4), (0.9, 0.98), (0, 0.4), 0.0),
    ("unseen reactance X ~ U(0.75, 1.25), test 95-99.5 %", (0.1, 0.995), (0, 0.4), (0.95, 0.995), (0, 0.4), 0.25),
    (
        "f0 on lagging k in [0, 0.4], test leading k in [-0.5, -0.2]",
        (0.1, 0.98),
        (0, 0.4),
        (0.9, 0.98),
        (-0.5, -0.2),
        0.0,
    ),
]


def _draw(n, loads, factors, spread, seed):
    rng, rows = random.Random(seed), []
    for _ in range(n):
        load, k, X = rng.uniform(*loads), rng.uniform(*factors), rng.uniform(1 - spread, 1 + spread)
        p = load * pf.p_max(k, X)
        theta, v = pf.solution(p, k * p, X)
        rows.append({"prompt": [p, k * p], "target": [theta, v], "x_line": X})
    return rows


def _nr(starts, rows):
    """(failure share, mean updates) of warm starts [N,2] on rows (each with its own reactance)."""
    s = torch.tensor([r["prompt"] for r in rows], dtype=torch.float64)
    labels, solved = torch.empty(len(rows), dtype=torch.float64), torch.empty(len(rows), dtype=torch.bool)
    for i, r in enumerate(rows):
        labels[i : i + 1], solved[i : i + 1] = pf.iterations(starts[i : i + 1], s[i : i + 1], X=r["x_line"])
    return 1 - float(solved.double().mean()), float(labels.mean())


def fit_f0(demos, seed):
    policy = GaussianPolicy(init_seed=seed)
    update = {"name": "adamw", "lr": 1e-2, "warmup_steps": 20, "max_grad_norm": 1.0}
    SFT(steps=400, batch_size=64, update=update).fit(
        policy, demos, [], seed, lambda step, rows, i: policy.encode(rows[i]["prompt"]), None, lambda *a: None
    )
    return policy


def precondition(seeds):
    results = []
    for label, loads, factors, test_loads, test_factors, spread in VARIANTS:
        demos, test = _draw(4096, loads, factors, spread, 1), _draw(512, test_loads, test_factors, spread, 2)
        s = torch.tensor([r["prompt"] for r in test], dtype=torch.float64)
        flat = _nr(torch.tensor([[0.0, 1.0]], dtype=torch.float64).expand(len(test), 2), test)
        fits = []
        for seed in seeds:
            f0 = fit_f0(demos, seed)
            with torch.no_grad():
                fits.append(_nr(f0.net(s), test))
        row = {"variant": label, "flat": flat, "f0": fits}
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def _trainer(out, seed, overrides=(), recipe="newtons_lantern"):
    cfg, _ = load_config(recipe, [f'out="{out}"', f"seed={seed}", *overrides])
    return Trainer(build(cfg))


def heavy_train_rows(n=256):
    """Heavy snapshots (>= 90 % of the nose point) of the *train* split: what the pilot reads."""
    return [r for r in TASKS["powerflow2"].rows("train", 0, 0) if r["heavy"]][:n]


def pilot(seeds, overrides, recipe):
    rows = heavy_train_rows()
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = _trainer(tmp, seed, ["eval.size=0", *overrides], recipe)
            run, heldout, curve = Run(trainer), HeldOut(trainer), []
            run.train()  # the sft phase, then train.steps RL steps; read the curve from checkpoints below
            curve.append(heldout.evaluate_detail(rows=rows, split="train")["reward_mean"])
            line = {"seed": seed, "recipe": recipe, "overrides": overrides, "heavy_train_reward_mean": curve}
            print(json.dumps(line), flush=True)


def plot(seed, steps):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    test = TASKS["powerflow2"].rows("test", 0, 0)
    s = torch.tensor([r["prompt"] for r in test], dtype=torch.float64)
    target = torch.tensor([r["target"] for r in test], dtype=torch.float64)
    loads = torch.tensor([r["load"] for r in test])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(tmp, seed, [f"train.steps={steps}", "eval.size=0"])
        Run(trainer).train()
        with torch.no_grad():
            rl, f0 = trainer.policy.net(s), trainer.policy.reference.net(s)  # [N,2] deployed means
    starts = {"flat start": torch.tensor([[0.0, 1.0]]).expand(len(test), 2), "f0 (supervised)": f0, "RL": rl}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    edges = torch.linspace(0.9, 0.98, 9)
    for (name, x), colour in zip(starts.items(), ["grey", "tab:blue", "tab:red"]):
        labels, solved = pf.iterations(x.double(), s)
        means = [float(labels[(loads >= a) & (loads < b)].mean()) for a, b in zip(edges[:-1], edges[1:])]
        left.step(
            edges,
            [*means, means[-1]],
            where="post",
            color=colour,
            label=f"{name}: mean {float(labels.mean()):.2f}, {100 * float(solved.double().mean()):.0f} % converge",
        )
    left.set(
        xlabel="load level (share of the nose-point load)",
        ylabel="Newton-Raphson updates",
        title="heavy held-out snapshots",
    )
    left.legend(fontsize=8)
    # the error of each warm start from the solution, over the update counts around one snapshot at 95 %
    row = pf.snapshot(0.95, 0.2)
    d = torch.linspace(-0.25, 0.25, 81)
    grid = torch.stack(torch.meshgrid(d, d, indexing="xy"), -1).view(-1, 2).double()  # [M,2] (dθ, dV)
    counts, _ = pf.iterations(grid + torch.tensor(row["target"]), torch.tensor([row["prompt"]]).expand(len(grid), 2))
    mesh = right.pcolormesh(d, d, counts.view(81, 81), cmap="Greys", shading="auto", vmin=0, vmax=20)
    fig.colorbar(mesh, ax=right, label="updates from (θ*+dθ, V*+dV), one snapshot at 95 %")
    for name, x, colour in (("f0", f0, "tab:blue"), ("RL", rl, "tab:red")):
        err = (x - target).float()
        right.scatter(err[:, 0], err[:, 1], s=4, color=colour, label=f"{name} error on each held-out snapshot")
    right.set(xlabel="dθ (rad)", ylabel="dV (p.u.)", title="warm-start errors; black = NR fails (20)")
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(FOLDER / "iterations.png", dpi=110)
    print(FOLDER / "iterations.png")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("what", choices=["precondition", "pilot", "plot"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--recipe", default="newtons_lantern", help="pilot: the recipe (newtons_lantern_learned)")
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "precondition":
        precondition(args.seeds)
    elif args.what == "pilot":
        pilot(args.seeds, args.overrides, args.recipe)
    else:
        plot(args.seed, args.steps)
