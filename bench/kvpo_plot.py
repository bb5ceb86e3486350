"""KVPO's toy: writes src/groupwise/papers/21_kvpo/trajectories.png.

Left, the mechanism (after the flow-matching fit of the shipped recipe ``kvpo``): for a few held-out
prompts, five ODE samples under shared noise (one trajectory) and the anchor with four cache-routed
branches (``rollout kv_branches``: frames 3–4 see an older frame in the cache's oldest slot). Right,
the deployed ODE (greedy) on the same prompts after the fit, after ``--steps`` KVPO steps and after as
many Flow-GRPO steps (the claim's baseline: ``sde = "all"``, group sampling, ``ppo_clip``), each
trajectory with its target, and the mean held-out ``traj_global`` of the three on 128 prompts.

    python bench/kvpo_plot.py [--steps 30] [--seed 0] [--out PNG]
"""

from __future__ import annotations

import argparse
import importlib
import random
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from groupwise.build import build  # noqa: E402
from groupwise.config import load_config  # noqa: E402
from groupwise.hooks import KvRoute  # noqa: E402
from groupwise.modalities.ar_flow import ARFlowPolicy  # noqa: E402
from groupwise.phases import load_output  # noqa: E402
from groupwise.rollout.kv_branches import plan_kv_routing  # noqa: E402
from groupwise.run import Run  # noqa: E402
from groupwise.trainer import Trainer  # noqa: E402
from groupwise.types import Request, StepInfo  # noqa: E402

traj2d = importlib.import_module("groupwise.papers.21_kvpo.traj2d")
BASELINE = [
    'model.params={frames=6, window=3, steps=4, sde="all", train_from=0, shared_noise=false}',
    'rollout.name="sample"',
    'advantage.estimator="grpo"',
    'objective.terms=[{name="ppo_clip"}]',
]
INFO = StepInfo(0, 4321, 0)


def train(out: Path, steps: int, seed: int, overrides: list[str]) -> tuple[dict, dict]:
    cfg, _ = load_config("kvpo", [f'out="{out}"', f"train.steps={steps}", f"seed={seed}", "eval.size=0", *overrides])
    trainer = Trainer(build(cfg))
    Run(trainer).train()
    return load_output(out / "phases" / "sft.pt")["policy"], trainer.policy.state_dict()


def policy_of(state: dict) -> ARFlowPolicy:
    policy = ARFlowPolicy()
    policy.load_state_dict(state)
    return policy


def sequences(policy: ARFlowPolicy, prompts: list[list[float]], hooks=None, n: int = 1) -> torch.Tensor:
    reqs = [Request(key=i, n=n, prompt=p, hook=None if hooks is None else hooks[i]) for i, p in enumerate(prompts)]
    ro = policy.generate(reqs, {"greedy": True}, INFO)
    history = torch.tensor(prompts, dtype=torch.float32)[:, :6].view(-1, 1, 3, 2).expand(-1, n, -1, -1)
    return torch.cat([history, ro.extras["frames"]], dim=2)  # [P,n,9,2]


def held_out_reward(policy: ARFlowPolicy, rows: list[dict]) -> float:
    prompts = [r["prompt"] for r in rows]
    ro = policy.generate([Request(key=i, n=1, prompt=p) for i, p in enumerate(prompts)], {"greedy": True}, INFO)
    return float(traj2d.TrajGlobal().score_rollout(ro, INFO).mean())


def routes(n_prompts: int) -> list[KvRoute]:
    rng = random.Random(0)
    out = []
    for _ in range(n_prompts):
        sources = torch.full((5, 2, 1), -1, dtype=torch.long)
        for p, f in enumerate((2, 3)):
            sources[1:, p] = torch.tensor(plan_kv_routing(3 + f, 3, 2, 4, rng))
        out.append(KvRoute(frames=torch.tensor([2, 3]), sources=sources))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="src/groupwise/papers/21_kvpo/trajectories.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fitted, kvpo = train(Path(tmp) / "kvpo", args.steps, args.seed, [])
        _, sde = train(Path(tmp) / "sde", args.steps, args.seed, BASELINE)
    rows = traj2d.traj_rows(128, 777)
    shown = [r["prompt"] for r in rows[:3]]
    fit = policy_of(fitted)
    same = sequences(fit, shown, n=5)  # [3,5,9,2] one trajectory each
    routed = sequences(fit, shown, routes(3), n=5)  # [3,5,9,2] anchor + 4 branches
    arms = {"fit": fit, "KVPO": policy_of(kvpo), "Flow-GRPO (SDE)": policy_of(sde)}
    fig, axes = plt.subplots(1, 2 + len(arms), figsize=(5 * (2 + len(arms)), 5))
    colours = ["tab:blue", "tab:orange", "tab:green"]
    for ax, seqs, title in ((axes[0], same, "5 ODE samples, shared noise"), (axes[1], routed, "anchor + 4 routed")):
        for i, c in enumerate(colours):
            for g in range(5):
                xy = seqs[i, g].numpy()
                ax.plot(xy[:, 0], xy[:, 1], "-o", color=c, ms=3, lw=2.5 if g == 0 else 1, alpha=1 if g == 0 else 0.6)
            t = shown[i][6:]
            ax.plot(t[0], t[1], "*", color=c, ms=14, mec="k")
        ax.set_title(title)
    for ax, (name, policy) in zip(axes[2:], arms.items()):
        seqs = sequences(policy, shown)
        for i, c in enumerate(colours):
            xy = seqs[i, 0].numpy()
            ax.plot(xy[:3, 0], xy[:3, 1], "-o", color="grey", ms=3)
            ax.plot(xy[2:, 0], xy[2:, 1], "-o", color=c, ms=3)
            t = shown[i][6:]
            ax.plot(t[0], t[1], "*", color=c, ms=14, mec="k")
        ax.set_title(f"{name}: held-out traj_global {held_out_reward(policy, rows):.3f}")
    for ax in axes:
        ax.set_aspect("equal")
    fig.suptitle(f"KVPO toy (traj2d), seed {args.seed}, {args.steps} RL steps; stars: targets")
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print(args.out)


if __name__ == "__main__":
    main()
