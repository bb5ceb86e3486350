"""The masked-diffusion toy at a glance (papers/54_daca_grpo/unmasking.png): how the shipped fit
(models/mdlm_sum_pairs) unmasks its canvas and what the DACA-GRPO weights make of it.

Left: for 300 sampled completions of the 50 held-out prompts (seed 0), the share of rows that commit
each canvas position at each of the 8 steps. Right: the denoising progress weights (weight dps) of
those tokens against their commit step.

    PYTHONPATH=src python bench/mdlm_plot.py [--out papers/54_daca_grpo/unmasking.png]
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from groupwise.policy.kinds import build_policy  # noqa: E402
from groupwise.tasks.sum_pairs import rows  # noqa: E402
from groupwise.types import Request, StepInfo  # noqa: E402
from groupwise.weights.dps import DenoisingProgress  # noqa: E402


class _Model:
    policy, path, params, device = "mdlm", "mdlm_sum_pairs", {}, "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", default="papers/54_daca_grpo/unmasking.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = build_policy(_Model(), None)
    info = StepInfo(step=0, seed=0, max_new_tokens=0)
    batch = policy.generate([Request(key=i, n=6, prompt=r["prompt"]) for i, r in enumerate(rows("test", 0))], {}, info)
    commit = batch.extras["commit_step"].reshape(-1, policy.length)  # [N,L]
    share = torch.stack([(commit == s + 1).double().mean(0) for s in range(policy.steps)])  # [S,L]
    w = DenoisingProgress()(batch, info).reshape(-1)  # [N*L]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    image = left.imshow(share.numpy(), cmap="viridis", aspect="auto", origin="lower")
    left.set_xlabel("canvas position (a, +, b, then EOS padding)")
    left.set_ylabel("commit step")
    left.set_yticks(range(policy.steps), [str(s + 1) for s in range(policy.steps)])
    left.set_title("share of rows committing a position at a step")
    fig.colorbar(image, ax=left)
    right.scatter(commit.reshape(-1).numpy() + 0.15 * torch.randn(w.numel()).numpy(), w.numpy(), s=3, alpha=0.3)
    right.set_xlabel("commit step (jittered)")
    right.set_ylabel("dps weight (mean 1 per row)")
    right.set_title("denoising progress weights")
    fig.suptitle("mdlm_sum_pairs: 300 samples of the 50 held-out prompts, seed 0")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
