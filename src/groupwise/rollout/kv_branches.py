"""KVPO's exploration: per prompt, one unperturbed anchor generation and K branches that differ only in
which older frames the generator's cache holds inside a perturbation window.

KVPO: arXiv 2605.14278 (spec 21); the reference read is the authors'
``models/longlive/pipeline/diversity_sampling.py`` (``DiversitySamplingPipeline.plan_perturbation``),
as the spec quotes it: keep the ``m_nearest_frames`` most recent frames, fill the rest of the local
window with a random selection of older frames, different per branch, all branches sharing the noise.

**Change vs GRPO**: a deterministic (ODE) generator samples one trajectory per prompt whatever the
group size, so the group's rows are made different by a generation hook (``groupwise.hooks.KvRoute``),
not by noise. Row 0 of each group is the anchor (row flag ``anchor``: scored, in the advantage
statistics, never trained); rows 1..K are the branches.

**Math** (a group of G = K + 1 rows; the policy's cache holds W frames; frame f sits at sequence
position p = 3 + f after the prompt's 3 frames)::

    row 0:          the clean cache at every frame                               (the anchor)
    row g = 1..K:   for each f in ``frames``: the S = W − keep_nearest oldest cache slots hold the frames at
                    positions c, a sorted draw of S distinct positions < p − keep_nearest, c ≠ the clean ones

**Defaults** (the toy's; [INFERRED] unless tagged)

- ``frames = [2, 3]``: the perturbation window, frames 3–4 of 6 (1-based; the design's choice; the
  authors perturb ``perturb_num_blocks = 5`` blocks within the first 7 [CODE]).
- ``keep_nearest = 2`` (W = 3: one slot routed). The authors keep ``m_nearest_frames = 4`` of a
  12 − 3 frame budget [CODE]; in a 3-frame cache the two nearest frames carry the motion and the third
  its curvature, so routing one slot changes the storyline (the curve) without breaking the motion.
- K = ``rollout.group_size`` − 1; the authors' K = 8 [CODE], the toy's 4 (group_size 5).

**Notes**

1. The draw of every group comes from ``random.Random(sample_seed(seed, step, key, −1))``: identical
   on every rank, independent of the rest of the batch.
2. The policy must apply ``kv_route`` (``hooks``; ``ar_flow`` with ``sde = "none"``), and should share
   its noise across a request's rows (``shared_noise = true``), so that routing is the only difference.
3. ``step_stats``: ``kv/anchor_reward`` (the anchors' mean), ``kv/branch_std`` (the mean over groups
   of the branches' reward std), ``kv/beats_anchor`` (the share of branches above their anchor).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import torch

from groupwise.errors import ConfigError
from groupwise.hooks import KvRoute
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.seeds import sample_seed
from groupwise.types import ANCHOR, Request, Rollout

PROMPT_FRAMES = 3  # the ar_flow prompt's history frames (modalities/ar_flow.py)


def plan_kv_routing(pos: int, window: int, keep_nearest: int, k: int, rng: random.Random) -> list[list[int]]:
    """``k`` plans for the frame at sequence position ``pos``: each the sorted positions of the S = window −
    keep_nearest frames that fill the cache's oldest slots, drawn uniformly (with replacement across plans)
    among the S-subsets of positions < pos − keep_nearest other than the clean cache's."""
    S = window - keep_nearest
    clean = tuple(range(pos - window, pos - keep_nearest))
    choices = [c for c in itertools.combinations(range(pos - keep_nearest), S) if c != clean]
    if not choices:
        raise ConfigError(
            f"rollout kv_branches: the frame at position {pos} has no older frames to route into {S} slots; "
            "perturb later frames (rollout.params frames) or keep fewer (keep_nearest)"
        )
    return [list(rng.choice(choices)) for _ in range(k)]


@register("rollout", "kv_branches")
@dataclass
class KVBranches:
    """One clean anchor and K cache-routed branches per prompt, sharing the noise (KVPO, arXiv 2605.14278)."""

    frames: list[int] = field(default_factory=lambda: [2, 3])
    keep_nearest: int = 2

    hooks = ("kv_route",)

    def __post_init__(self) -> None:
        if not self.frames or any(f < 0 for f in self.frames) or self.keep_nearest < 1:
            raise ConfigError(
                f"rollout kv_branches: need frames (>= 0, 0-based) and keep_nearest >= 1; got {self.frames}, "
                f"{self.keep_nearest}"
            )
        self._stats: dict[str, float] = {}

    def _hook(self, key: int, G: int, window: int, seed: int, step: int) -> KvRoute:
        if not 1 <= self.keep_nearest < window:
            raise ConfigError(
                f"rollout kv_branches: keep_nearest = {self.keep_nearest} must be in 1..{window - 1} (the policy's "
                f"cache holds {window} frames)"
            )
        rng = random.Random(sample_seed(seed, step, key, -1))
        plans = [plan_kv_routing(PROMPT_FRAMES + f, window, self.keep_nearest, G - 1, rng) for f in self.frames]
        S = window - self.keep_nearest
        sources = torch.full((G, len(self.frames), S), -1, dtype=torch.long)  # [G,P,S] row 0: the anchor
        for p, plan in enumerate(plans):
            sources[1:, p] = torch.tensor(plan, dtype=torch.long)
        return KvRoute(frames=torch.tensor(self.frames, dtype=torch.long), sources=sources)

    def __call__(self, ctx: RolloutContext) -> Rollout:
        G = ctx.group_size
        if G < 2:
            raise ConfigError("rollout kv_branches: rollout.group_size must be >= 2 (one anchor and K >= 1 branches)")
        window = int(getattr(ctx.policy, "window", 0))
        info = ctx.info(0)
        ids = ctx.draw(ctx.batch_size, 0)
        requests = [Request(key=i, n=G, hook=self._hook(i, G, window, info.seed, info.step)) for i in ids]
        batch = ctx.rollout(requests, 0)
        B = batch.shape[0]
        anchor = torch.zeros(B, G, dtype=torch.bool)
        anchor[:, 0] = True
        batch.set_flag(ANCHOR, anchor & batch.group_valid)
        if batch.rewards is None:
            raise ValueError(
                "rollout kv_branches: the scored batch has no rewards (configure rewards or a task reward)"
            )
        r = batch.rewards.double()  # [B,G]
        branches = r[:, 1:]  # [B,K]
        self._stats = {
            "kv/anchor_reward": float(r[:, 0].mean()),
            "kv/branch_std": float(branches.std(1).mean()) if G > 2 else 0.0,
            "kv/beats_anchor": float((branches > r[:, :1]).double().mean()),
        }
        return batch

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)
