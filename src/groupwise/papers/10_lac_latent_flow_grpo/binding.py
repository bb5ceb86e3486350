"""``flow_binding``: LAC's toy (spec 10's binding toy, design note §3 "10 LAC"): an ordered pair of
modes, drawn as a 2-point "image".

"LAC: Latent Action Control with Latent-Flow GRPO", arXiv 2605.16961,
https://arxiv.org/abs/2605.16961 (abstract only; spec status ABSTRACT). Everything here is the toy
[INFERRED].

**Change vs GRPO**: none to the algorithm; a non-text task, its reward, and the held-out measures
(:func:`greedy_binding`). Prompt label ``y`` names the ordered pair (i, j), i ≠ j, of ``N_MODES = 4``
modes μ_m = ring·(cos 2πm/4, sin 2πm/4) (12 labels, :data:`PAIRS`). A sample x ∈ R^4 is two points
p1 = x[0:2], p2 = x[2:4]. The generator's own condition is the unordered bag {i, j}
(:func:`bag_labels`: each label's generator label is that of (min, max)), so only the planner can
carry the order.

**Math** (reward ``binding_reward``, a rollout scorer; x the row's sample, (i, j) its pair)::

    hit(p, m) = 1[‖p − μ_m‖ < radius]
    score     = 1                if hit(p1, i) and hit(p2, j)        (bound)
              = swapped          if hit(p1, j) and hit(p2, i)        (the bag's other order; 0 by default)
              = 0                otherwise

**Defaults** (the toy's; all [INFERRED]): ``ring = 2``, ``radius = 0.75``, ``swapped = 0``;
demonstrations ``target = [μ_i, μ_j] + demo_noise·ε`` with ``demo_noise = 0.1``; 1024 train rows,
64 held-out (another seed).

**Notes**

1. The reward reads each row's own label (``row_labels``: its context's), so a row scored in another
   group than its prompt's is scored against its own pair; invalid rows score 0.
2. ``greedy_binding`` deploys the policy on each of the 12 pairs once (greedy: planner mean, then the
   ODE); ``donor_follow`` reruns only the generator (``_generate_flow``) on the swapped pair's latents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from groupwise.modalities.flow_sde import row_labels
from groupwise.registry import register
from groupwise.tasks import Task, register_task
from groupwise.types import Request, Rollout, StepInfo

N_MODES = 4
PAIRS = [(i, j) for i in range(N_MODES) for j in range(N_MODES) if i != j]  # label y -> its ordered pair (i, j)


def mode_centres(ring: float = 2.0) -> Tensor:
    """[N_MODES,2] float64: μ_m = ring·(cos 2πm/4, sin 2πm/4)."""
    angle = 2 * math.pi * torch.arange(N_MODES, dtype=torch.float64) / N_MODES
    return ring * torch.stack([angle.cos(), angle.sin()], dim=-1)


def bag_labels() -> list[int]:
    """Each label's generator label under the bag condition: the label of its pair in (min, max) order,
    so (i, j) and (j, i) look the same to the generator (``PlannerPolicy(generator_sees="bag", bag=...)``)."""
    return [PAIRS.index((min(i, j), max(i, j))) for i, j in PAIRS]


def binding_rows(n: int, seed: int, ring: float = 2.0, demo_noise: float = 0.1) -> list[dict]:
    """``n`` rows ``{"prompt": y, "pair": [i, j], "priors": [μ_i, μ_j], "target": [p1, p2]}`` (seeded): a
    label uniform over the 12 ordered pairs and one demonstration of it (module docstring); ``priors``
    (4 numbers) is stage 1's training-only prior (phase ``lac_align``)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(len(PAIRS), (n,), generator=g)  # [n]
    noise = torch.randn(n, 4, generator=g, dtype=torch.float64)  # [n,4]
    mu = mode_centres(ring)  # [M,2]
    pairs = torch.tensor(PAIRS)[labels]  # [n,2]
    target = mu[pairs].reshape(n, 4) + demo_noise * noise  # [n,4]
    return [
        {"prompt": int(y), "pair": list(PAIRS[int(y)]), "priors": c, "target": t}
        for y, c, t in zip(labels.tolist(), mu[pairs].reshape(n, 4).tolist(), target.tolist())
    ]


def binding_score(x: Tensor, labels: Tensor, ring: float = 2.0, radius: float = 0.75, swapped: float = 0.0) -> Tensor:
    """[...] float32 score of samples x [...,4] for labels [...] (module docstring)."""
    mu = mode_centres(ring)  # [M,2]
    pairs = torch.tensor(PAIRS)[labels.long()]  # [...,2]
    p1, p2 = x[..., :2].double(), x[..., 2:].double()  # [...,2]

    def hit(p: Tensor, m: Tensor) -> Tensor:
        return torch.linalg.vector_norm(p - mu[m], dim=-1) < radius  # [...]

    bound = hit(p1, pairs[..., 0]) & hit(p2, pairs[..., 1])  # [...]
    swap = hit(p1, pairs[..., 1]) & hit(p2, pairs[..., 0])  # [...]
    return (bound.double() + swapped * (swap & ~bound).double()).float()


@register("reward", "binding_reward")
@dataclass
class BindingReward:
    """LAC's toy binding reward: both points in their own modes, in the prompt's order."""

    ring: float = 2.0  # [INFERRED] the modes' ring radius
    radius: float = 0.75  # [INFERRED] how close a point must land to its mode
    swapped: float = 0.0  # [INFERRED] the score of the bag's other order (the design's optional 0.5)
    weight: float = 1.0

    needs = ()

    def __post_init__(self) -> None:
        if self.ring <= 0 or self.radius <= 0 or not 0 <= self.swapped < 1:
            raise ValueError(
                f"binding_reward: need ring > 0 ({self.ring}), radius > 0 ({self.radius}), 0 <= swapped < 1 "
                f"({self.swapped})"
            )

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        x = rollout.extras.get("x_final")
        if x is None or x.shape[-1] != 4:
            raise ValueError(
                "binding_reward needs the row extra 'x_final' [B,G,4] (two 2-D points: a planner or flow policy "
                f"with dim = 4), got {None if x is None else tuple(x.shape)}"
            )
        labels = row_labels(rollout)  # [B,G] each row's own label
        score = binding_score(x, labels, self.ring, self.radius, self.swapped)  # [B,G]
        return torch.where(rollout.group_valid.bool(), score, torch.zeros(()))  # [B,G]


def greedy_binding(policy: Any, ring: float = 2.0) -> dict[str, float]:
    """The deployed policy (planner mean or argmax, then the ODE) on each of the 12 ordered pairs once:
    ``binding_acc`` the share bound in order; ``donor_follow`` the share that, given the plan (latents or
    think tokens) the planner makes for the swapped pair (j, i) instead of its own, draws (j, i): the
    plan is consumed (the paper's intervention check)."""
    info = StepInfo(step=0, seed=0, max_new_tokens=0)
    labels = torch.arange(len(PAIRS))  # [Y]
    requests = [Request(key=int(y), n=1, prompt=[int(y)]) for y in labels]
    own = policy.generate(requests, {"greedy": True}, info)
    swapped = torch.tensor([PAIRS.index((j, i)) for i, j in PAIRS])  # [Y]
    donors = policy.generate([Request(key=int(y), n=1, prompt=[int(y)]) for y in swapped], {"greedy": True}, info)
    with torch.no_grad():
        plan = policy.planner.condition_of(donors.extras[policy.planner.row_extra])  # [Y,1,K,...] either planner's
        moved = policy._generate_flow(requests, {"greedy": True}, info, plan)
    bound = binding_score(own.extras["x_final"][:, 0], labels, ring)  # [Y]
    follow = binding_score(moved.extras["x_final"][:, 0], swapped, ring)  # [Y]
    return {"binding_acc": float(bound.mean()), "donor_follow": float(follow.mean())}


def _rows(split: str, n: int, seed: int) -> list[dict]:
    size = n or (1024 if split == "train" else 64)
    return binding_rows(size, seed if split == "train" else seed + 10_007)


register_task(
    Task(
        "flow_binding",
        "LAC's binding toy: draw two points, in the modes of an ordered pair (i, j) and in that order (spec 10)",
        _rows,
        reward="binding_reward",
    )
)
