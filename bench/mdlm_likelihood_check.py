"""Spec 54's estimator check (design nontext.md §3 54, claim (a) as a one-off measurement): on
completions the fitted masked-diffusion LM samples for held-out sum_pairs prompts, how well does each
cheap sequence log-likelihood estimate rank them like a high-sample Monte-Carlo ELBO?

For each seed: 50 held-out prompts × 6 samples (300 rows, the sampler's own seeds), then per row
the sums over the canvas of ``strat_logp(4)`` (SML), ``strat_logp(1)`` (mean-field) and
``elbo(M)`` (the reference, M = 256 by default, a multiple of L = 8); Spearman's rank correlation of
each estimator with the reference. Prints one JSON line per seed and the mean over seeds.

    PYTHONPATH=src python bench/mdlm_likelihood_check.py [--path mdlm_sum_pairs] [--seeds 1000 1001 ...]
"""

from __future__ import annotations

import argparse
import json

import torch

from groupwise.policy.kinds import build_policy
from groupwise.tasks.sum_pairs import check_pair, rows
from groupwise.types import Request, StepInfo


def ranks(x: torch.Tensor) -> torch.Tensor:
    """[N] average ranks (ties share the mean of their positions)."""
    order = torch.argsort(x, stable=True)
    r = torch.empty(len(x), dtype=torch.float64)
    r[order] = torch.arange(len(x), dtype=torch.float64)
    for value in torch.unique(x):
        tied = x == value
        if int(tied.sum()) > 1:
            r[tied] = r[tied].mean()
    return r


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


class _Model:
    def __init__(self, path):
        self.policy, self.path, self.params, self.device = "mdlm", path, {}, "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--path", default="mdlm_sum_pairs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1000, 1001, 1002, 1003, 1004])
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--draws", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = build_policy(_Model(args.path), None)
    prompts = rows("test", 0)
    out_rows = []
    for seed in args.seeds:
        requests = [Request(key=i, n=args.samples, prompt=r["prompt"]) for i, r in enumerate(prompts)]
        batch = policy.generate(requests, {}, StepInfo(step=0, seed=seed, max_new_tokens=0))
        with torch.no_grad():
            got = policy.forward(batch, ("strat_logp(4)", "strat_logp(1)", f"elbo({args.draws})"))
        seq = {k: v.sum(-1).reshape(-1).double() for k, v in got.items()}  # each [B*G]
        ref = seq[f"elbo({args.draws})"]
        right = sum(check_pair(c, r["target"]) for cs, r in zip(batch.completions, prompts) for c in cs)
        line = {
            "seed": seed,
            "rows": len(ref),
            "sample_accuracy": right / len(ref),
            "spearman_sml": spearman(seq["strat_logp(4)"], ref),
            "spearman_mf": spearman(seq["strat_logp(1)"], ref),
        }
        line["spearman_gap"] = line["spearman_sml"] - line["spearman_mf"]
        out_rows.append(line)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in line.items()}), flush=True)
    mean = {k: sum(r[k] for r in out_rows) / len(out_rows) for k in ("spearman_sml", "spearman_mf", "spearman_gap")}
    print(json.dumps({"mean": {k: round(v, 4) for k, v in mean.items()}, "seeds": args.seeds}))


if __name__ == "__main__":
    main()
