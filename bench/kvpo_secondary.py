"""KVPO's secondary read (design note §3 "21 KVPO": the demonstrations' smoothness stays closer to the fit
under KVPO), on the saved policies of a ``groupwise claims --confirm 21-kvpo`` folder: for each arm and seed,
the deployed ODE's mean speed change (``traj2d.speed_changes``, the jerk the rewards penalise) and mean
distance of the last frame to the target on 256 held-out prompts, after the fit and after RL.
Not a registered claim: a descriptive read of the claim's runs.

    python bench/kvpo_secondary.py [FOLDER]      (default runs/claims/confirm/21-kvpo)
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from groupwise.modalities.ar_flow import ARFlowPolicy
from groupwise.phases import load_output
from groupwise.types import Request, StepInfo

traj2d = importlib.import_module("groupwise.papers.21_kvpo.traj2d")
ROWS = traj2d.traj_rows(256, 10_007)
INFO = StepInfo(0, 4321, 0)


def read(state: dict) -> tuple[float, float]:
    """(mean jerk, mean final distance to the target) of the greedy ODE on ROWS."""
    policy = ARFlowPolicy()
    policy.load_state_dict(state)
    ro = policy.generate([Request(key=i, n=1, prompt=r["prompt"]) for i, r in enumerate(ROWS)], {"greedy": True}, INFO)
    seq, target = traj2d._sequences(ro, "kvpo_secondary")
    return float(traj2d.speed_changes(seq).mean()), float((seq[:, 0, -1] - target[:, 0]).norm(dim=-1).mean())


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/claims/confirm/21-kvpo")
    for arm in sorted(p for p in folder.iterdir() if p.is_dir()):
        for run in sorted(arm.glob("seed*")):
            fit = read(load_output(run / "phases" / "sft.pt")["policy"])
            after = read(torch.load(run / "final" / "ar_flow_policy.pt", weights_only=False))
            print(
                f"{arm.name} {run.name}: jerk {fit[0]:.4f} -> {after[0]:.4f}, distance {fit[1]:.3f} -> {after[1]:.3f}"
            )


if __name__ == "__main__":
    main()
