"""Seeded Gaussian reward noise: a rollout scorer that adds N(0, sigma²) per completion (robustness tests);
``dist = "cauchy"`` makes it heavy-tailed.

Not a paper's method: the noisy-reward toy of specs/38 (SLAS: "on a noisy-reward text toy, SLAS is
less affected by reward noise of small magnitude") and of any claim about noise robustness; its
heavy-tailed form is specs/56's "heavy-tailed RM" (Pair-GRPO's gradient-norm variance claim).

**Change vs GRPO**: none to the algorithm. Listed beside a task reward (``rewards = ["exact",
{name = "gaussian_noise", sigma = 0.05}]``) it corrupts the training reward by additive noise;
held-out accuracy still uses the task's own reward (``eval.reward``), so it measures the true one.

**Math**::

    score_{b,g} = sigma · ε_{b,g},   ε ~ N(0, 1) drawn from sample_seed(seed, step, prompt_id_b, g)   # [B,G]
    dist = "cauchy":  ε = z_1 / z_2 with z_1, z_2 ~ N(0, 1) from the same seed (standard Cauchy)

**Defaults**

- ``sigma = 0.1`` [INFERRED] small beside a 0/1 task reward.
- ``dist = "normal"`` [INFERRED]; ``"cauchy"`` [INFERRED] a heavy-tailed noise (no mean, no variance:
  a few rows per batch get scores far outside the task reward's range).
- ``weight = 1.0`` [CODE] TRL ``GRPOConfig.reward_weights = None`` weighs every reward 1.0.

**Notes**

1. A *rollout scorer* (``score_rollout``), modality-free: it reads only the batch's shape and ids.
2. Each row's noise comes from its own seed ``(seed, step, prompt id, row index)``
   (``seeds.sample_seed``), so it does not depend on the batch composition or the world
   size and a resumed run draws the same noise. The row index is the position in the group.
3. Invalid rows (``group_valid`` False) score 0.
4. With ``dist = "normal"`` the draws are the same as before the option existed (one normal per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.seeds import sample_seed
from groupwise.types import Rollout, StepInfo

DISTS = ("normal", "cauchy")


@register("reward", "gaussian_noise")
@dataclass
class GaussianNoise:
    """sigma · N(0, 1) per completion, seeded per row (a noisy-reward toy)."""

    sigma: float = 0.1
    dist: str = "normal"  # "normal" | "cauchy"
    weight: float = 1.0

    needs = ()

    def __post_init__(self) -> None:
        if not self.sigma >= 0:
            raise ValueError(f"gaussian_noise: sigma must be >= 0, got {self.sigma}")
        if self.dist not in DISTS:
            raise ValueError(f"gaussian_noise: dist must be one of {DISTS}, got {self.dist!r}")

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        B, G, _ = rollout.shape
        ids = rollout.prompt_index.tolist()  # [B]
        eps = torch.tensor(
            [
                [
                    self._draw(torch.Generator().manual_seed(sample_seed(info.seed, info.step, int(ids[b]), g)))
                    for g in range(G)
                ]
                for b in range(B)
            ],
            dtype=torch.float32,
        )  # [B,G]
        return torch.where(rollout.group_valid.bool(), self.sigma * eps, torch.zeros(()))  # [B,G]

    def _draw(self, generator: torch.Generator) -> float:
        if self.dist == "normal":
            return torch.randn((), generator=generator).item()
        z = torch.randn(2, generator=generator, dtype=torch.float64)  # [2]
        return float(z[0] / z[1])
