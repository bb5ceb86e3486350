"""VSPO: each group is sampled under a grid of steering intensities (positive, zero, negative) of a
behaviour steering vector added to the residual stream; the unsteered policy is updated.

"VSPO: Vector-Steered Policy Optimization", arXiv 2605.15604, https://arxiv.org/abs/2605.15604 —
spec 17 (abstract and a public knowledge-graph note: "generates each GRPO rollout group under a
range of positive, zero, and negative steering-vector intensities. It rewards task quality together
with the steering coefficient, then updates the unsteered policy from the steered trajectories").
No code; the layer, the grid, the reward weights and the ratio are the spec's reconstruction.

**Change vs GRPO**: row g of every group samples with ``α_g · v`` added to the residual stream
after decoder layer ``l`` at every position (a generation hook, ``groupwise.hooks.ResidualAdd``);
``v`` is the contrastive (CAA) steering vector the offline phase ``steering_vector``
(``phases/steering_vector.py``) computes before RL. Rewards combine the task and the behaviour
(the reward stage's weighted sum: a behaviour scorer with weight λ_b, or the steering coefficient
itself through the reward ``row_extra``). Every row is stored as sampled from the clean policy:
old log-probs, needs and the loss use the unsteered model (the spec's default ratio, "latent
self-distillation").

**Math** (``G = rollout.group_size``, ``l`` and ``v`` from the artifact)::

    α_g      = alphas[g mod len(alphas)]                        round-robin over the grid
    hook     = ResidualAdd(layer = l, vector = v, alpha = [α_0 .. α_{G−1}])    h_l ← h_l + α_g v, every position
    extras   steer_alpha[b,g] = α_g,  steer_coef[b,g] = α_g / max_g' |α_g'|
    r_g      = r_task(y_g) + λ_b · r_beh(y_g)                   (vspo_rewards; the reward stage's weights)
    A_g      = the estimator over the group (all α together)
    ρ_t      = π_θ(y_t | x, y_<t) / π_old(y_t | x, y_<t)        both unsteered (the trainer's logp_old)

**Defaults**

- ``alphas = [-4, -2, -1, 0, 0, 1, 2, 4]`` [INFERRED] the spec's example grid for G = 8, in units
  of the artifact's vector (normalised to the typical hidden-state norm at the layer).
- ``artifact = "steering_vector"`` [INFERRED] the phase's default name.
- ratio: both unsteered [INFERRED] the spec's default; its option ``ratio = "steered_behaviour"``
  (the true importance ratio against the steered sampler) is the objective ``trust_region`` with
  ``anchor = "sampler"``, which reads ``logp_sampler`` (the steered log-probs), not a field here.
- behaviour reward: a scorer of the behaviour (the recipe: ``format``), or ``row_extra`` with
  ``key = "steer_coef"`` (the spec's option ``beh_reward = "steer_coef"``, α_g/α_max) [INFERRED].

**Notes**

1. A grid longer than G uses its first G entries (round-robin from 0); its length need not divide
   G. An all-zero grid (``alphas = [0.0]``) is the spec's control, reward-shaped GRPO: the same
   rollout path with every row unsteered (``steer_coef`` 0).
2. ``α = 0`` rows are exactly the clean model (the hook adds 0); their ``logp_sampler`` equals the
   clean old log-probs.
3. Row extras ``steer_alpha`` and ``steer_coef`` [B,G] float32 are set on the rows before they are
   scored (``Request.extras``), so rewards can read them. ``step_stats``: ``vspo/reward_at_<α>``,
   the mean finite reward of the rows of each distinct α.
4. A hooked call prefills each row separately (``policy/engine.py``). Refill rounds (dynamic
   sampling) work as in ``sample``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from groupwise.components import ReadsArtifact
from groupwise.errors import ConfigError
from groupwise.hooks import ResidualAdd, residual_module
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.rollout.sample import refill_rounds
from groupwise.types import Rollout

ALPHA, COEF = "steer_alpha", "steer_coef"  # row extras [B,G] float32


def vspo_rewards(task_r: Tensor, beh_r: Tensor, lam_b: float) -> Tensor:
    """r [B,G] = task_r + λ_b · beh_r."""
    return task_r + lam_b * beh_r


def alpha_rows(alphas: list[float], G: int) -> Tensor:
    """[G] the intensity of each row: ``alphas[g mod len(alphas)]``."""
    return torch.tensor([float(alphas[g % len(alphas)]) for g in range(G)])


@contextlib.contextmanager
def steering_hook(model: Any, layer: int, v: Tensor, alpha: float) -> Iterator[None]:
    """Within the block, the model's residual stream after decoder layer ``layer`` (0: the embeddings) gets
    ``alpha · v`` at every position."""
    module = residual_module(model, layer)

    def hook(_module, _inputs, output):
        if isinstance(output, tuple):
            return (output[0] + alpha * v.to(output[0].dtype), *output[1:])
        return output + alpha * v.to(output.dtype)

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def residual_at_last(model: Any, layer: int, prompts: list[list[int]]) -> Tensor:
    """[N,D] the residual stream after decoder layer ``layer`` at each prompt's last token (the model's own forward)."""
    captured: list[Tensor] = []
    module = residual_module(model, layer)

    def grab(_module, _inputs, output):
        captured.append((output[0] if isinstance(output, tuple) else output).detach())

    handle = module.register_forward_hook(grab)
    out = []
    try:
        for ids in prompts:  # one at a time: no padding to reason about (phases are short)
            captured.clear()
            model(input_ids=torch.tensor([ids], device=next(model.parameters()).device))
            out.append(captured[-1][0, -1].float().cpu())
    finally:
        handle.remove()
    return torch.stack(out)  # [N,D]


def compute_steering_vector(
    model: Any, layer: int, pos_prompts: list[list[int]], neg_prompts: list[list[int]], normalise: str = "hidden_norm"
) -> tuple[Tensor, dict[str, float]]:
    """CAA: ``v = mean h_l(x+)[last] − mean h_l(x−)[last]`` [D]; ``normalise``: ``"hidden_norm"``
    rescales it to unit norm × the mean ‖h_l‖ over all the prompts, ``"unit"`` to norm 1, ``"none"`` keeps it."""
    pos, neg = (
        residual_at_last(model, layer, pos_prompts),
        residual_at_last(model, layer, neg_prompts),
    )  # [N+,D], [N−,D]
    v = pos.mean(0) - neg.mean(0)  # [D]
    raw = float(v.norm())
    typical = float(torch.cat([pos, neg]).norm(dim=-1).mean())
    if raw == 0.0 and normalise != "none":
        raise ValueError(
            "the contrastive prompts give identical mean activations (v = 0): nothing to normalise; check the templates"
        )
    if normalise == "hidden_norm":
        v = v / raw * typical
    elif normalise == "unit":
        v = v / raw
    return v, {"raw_norm": raw, "hidden_norm": typical, "norm": float(v.norm())}


@register("rollout", "vspo")
@dataclass
class VSPO(ReadsArtifact):
    """Each group under a grid of steering intensities of a CAA behaviour vector; the unsteered policy is trained
    (VSPO)."""

    alphas: list = field(default_factory=lambda: [-4.0, -2.0, -1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
    artifact: str = "steering_vector"

    hooks = ("residual_add",)
    collects = (ALPHA, COEF)
    phase_hint = "the offline phase steering_vector"

    def __post_init__(self) -> None:
        if not self.alphas or not all(isinstance(a, (int, float)) and math.isfinite(a) for a in self.alphas):
            raise ConfigError(
                f"rollout vspo: alphas={self.alphas!r} must be a non-empty list of finite numbers (e.g. [-1, 0, 0, 1])"
            )
        self._stats: dict[str, float] = {}

    def _request_parts(self, G: int) -> tuple[ResidualAdd, dict[str, Tensor]]:
        """The hook of a group of G rows and its row labels (the same for every prompt)."""
        value = self.artifact_value()
        alpha = alpha_rows(self.alphas, G)  # [G]
        coef = alpha / max(max(abs(float(a)) for a in self.alphas), 1e-30)  # [G] all-zero grid: 0
        return ResidualAdd(layer=int(value["layer"]), vector=value["vector"].float(), alpha=alpha), {
            ALPHA: alpha,
            COEF: coef,
        }

    def __call__(self, ctx: RolloutContext) -> Rollout:
        G = ctx.group_size
        hook, extras = self._request_parts(G)
        batch = refill_rounds(ctx, lambda key, n: hook, extras)
        alpha = batch.extras[ALPHA]  # [B,G]
        ok = batch.group_valid & torch.isfinite(batch.rewards)  # [B,G]
        self._stats = {}
        for a in sorted(set(alpha_rows(self.alphas, G).tolist())):
            rows = ok & (alpha == a)  # [B,G]
            self._stats[f"vspo/reward_at_{a:g}"] = float(batch.rewards[rows].mean()) if rows.any() else float("nan")
        return batch

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
