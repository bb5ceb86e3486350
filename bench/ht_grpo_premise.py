"""The premise check of paper 12 (design ``nontext.md`` §3 12): on ``mdlm`` models fitted to
``layout_paint``, does the confidence-ordered sampler commit the layout tokens (positions 0–3)
before the detail tokens (4–15)? If not, the toy cannot test HT-GRPO's premise that early-committed
tokens are the structure.

``python bench/ht_grpo_premise.py --seeds 0 1 2`` fits one model per seed (the ``sft``
phase's demonstration path: the kind's masked-diffusion loss) and stops it at the first check whose
greedy layout success on the 32 layouts reaches ``--target`` (a partly fitted model, as RL starts
from), then samples ``--group`` canvases per layout (Gumbel draws, the kind's ``generate``) and
reports the mean ``commit_step`` (1..S) of positions 0–3 and 4–15, with the greedy canvases' too.
Under a position-blind order both means are (S+1)/2 = 2.5 (S = 4); layout strictly first gives
1.0 vs 3.0. ``--texture 1`` fits the variant whose details are fixed by the layout (no texture draw).
``--out DIR`` saves each seed's model as ``DIR/seed<k>``; ``--plot FILE`` draws the first seed's
sampled commit steps per position (``commit_order.png`` is ``--seeds 0 --plot ...``).

**Defaults** (all [INFERRED]): L = 16, S = 4 (4 tokens a step), ``allowed = "01234567"``, a 2 × 32
net, batch 64, AdamW lr 2e-3 (warm-up 50), a check every 50 steps, ``--target 0.5``, at most 1500 steps.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from groupwise.modalities.mdlm import MDLMPolicy
from groupwise.phases.sft import SFT
from groupwise.types import Request, StepInfo

task = importlib.import_module("groupwise.papers.12_ht_grpo.layout_paint")


def sample(policy: Any, data: list[dict], group: int, greedy: bool, seed: int, texture: int = task.TEXTURE):
    """(commit_step [N,L], layout success [N], detail share [N]) of ``group`` canvases per row."""
    requests = [Request(key=i, n=group, prompt=r["prompt"]) for i, r in enumerate(data)]
    out = policy.generate(requests, {"greedy": greedy}, StepInfo(step=0, seed=seed, max_new_tokens=0))
    parts = [task.score_parts(c, r["layout"], texture) for row, r in zip(out.completions, data) for c in row]
    commit = out.extras["commit_step"].reshape(-1, policy.length).double()  # [B*G,L]
    return commit, torch.tensor([p[0] for p in parts]), torch.tensor([p[1] for p in parts])


def layout_success(policy: Any, data: list[dict]) -> float:
    return float(sample(policy, data, 1, True, 0)[1].mean())  # the layout part alone: texture-blind


def plot(commit: torch.Tensor, steps: int, title: str, path: str) -> None:
    """The share of sampled canvases that commit each position at each step (commit [N,L], 1..S)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = torch.stack([(commit == s).double().mean(0) for s in range(1, steps + 1)])  # [S,L]
    fig, ax = plt.subplots(figsize=(7.5, 3.0))
    image = ax.imshow(share.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.axvline(3.5, color="white", lw=2)
    ax.set_xticks(range(commit.shape[1]))
    ax.set_yticks(range(steps), [str(s) for s in range(1, steps + 1)])
    ax.set_xlabel("canvas position (0-3 layout | 4-15 details)")
    ax.set_ylabel("commit step")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="share of canvases")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check(seed: int, args: argparse.Namespace) -> dict:
    policy = MDLMPolicy(
        width=args.width, layers=2, heads=4, length=task.LENGTH, steps=4, allowed="01234567", init_seed=seed
    )
    train, held = task.rows("train", 0, seed, args.texture), task.rows("test", 0, 0, args.texture)
    phase = SFT(
        steps=args.steps,
        batch_size=64,
        target_accuracy=args.target,
        eval_every=50,
        fine_eval_every=50,
        update={"name": "adamw", "lr": 2e-3, "warmup_steps": 50, "max_grad_norm": 1.0},
    )
    start = time.time()
    fit = phase.fit(
        policy,
        train,
        held,
        seed,
        lambda split, r, i: policy.encode(r[i]["prompt"]),
        lambda p, r, s: layout_success(p, r),
    )
    policy.eval()
    record = {
        "seed": seed,
        "texture": args.texture,
        "fit_steps": fit["steps"],
        "fit_seconds": round(time.time() - start, 1),
    }
    for name, greedy, group in (("sampled", False, args.group), ("greedy", True, 1)):
        commit, lay, det = sample(policy, held, group, greedy, 1000 + seed, args.texture)
        record[name] = {
            "commit_layout": round(float(commit[:, :4].mean()), 4),  # mean commit_step of positions 0-3
            "commit_detail": round(float(commit[:, 4:].mean()), 4),  # of positions 4-15
            "layout_first_share": round(float((commit[:, :4] == 1).double().mean()), 4),  # layout at step 1
            "layout_success": round(float(lay.mean()), 4),
            "detail_share": round(float(det.mean()), 4),
        }
        if args.plot and name == "sampled" and seed == args.seeds[0]:
            title = (
                f"layout_paint (texture W = {args.texture}), fit seed {seed}: {len(commit)} sampled canvases\n"
                f"mean commit step {record[name]['commit_layout']:.2f} (layout) vs {record[name]['commit_detail']:.2f}"
            )
            plot(commit, policy.steps, title, args.plot)
    if args.out:  # the weights and this record (the shipped models/mdlm_layout_paint is --seeds 0's)
        policy.save(f"{args.out}/seed{seed}")
        command = "python bench/ht_grpo_premise.py " + " ".join(args.argv)
        Path(f"{args.out}/seed{seed}/fit.json").write_text(json.dumps({"command": command, **record}, indent=1) + "\n")
    print(json.dumps(record), flush=True)
    return record


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--target", type=float, default=0.5)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--texture", type=int, default=task.TEXTURE, help="W: 1 = details fixed by the layout")
    parser.add_argument("--out", default="")
    parser.add_argument("--plot", default="", help="a PNG of the first seed's sampled commit steps per position")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)
    return [check(seed, args) for seed in args.seeds]


if __name__ == "__main__":
    main()
