"""Multi-intent groups: every group holds every intent, so preference RL cannot collapse onto one.

DIAL: "Driving Intents Amplify Planning-Oriented Reinforcement Learning", arXiv 2605.12625 (Li
Auto / Tsinghua / CUHK), project page https://mind-omni.github.io/projects/dial/index.html — spec
26. Only the abstract and the project page were read (no code): RL groups are "intent-balanced",
"8 × 2" = two samples per intent, 16 candidates per scene.

**Change vs GRPO**: GRPO samples the G rows of a prompt alike. Here the policy samples under a
discrete condition read from ``Request.extras`` (the flow toy's ``condition_extras``, with
classifier-free guidance ``cfg_w``), and a group of ``G = K·M`` rows holds ``M`` rows of each of
the ``K`` intents; the reward and the group advantage (normalised over all ``G`` rows) are
unchanged. ``mode = "single"`` is the paper's baseline, single-intent GRPO: the ``G`` rows all
sample under ``single_intent`` (−1, the default, is the null condition: unconditional sampling).

**Math** (``B = rollout.prompts_per_step``, ``G = rollout.group_size``)::

    intents = [0]*M + [1]*M + … + [K−1]*M        (multi; G must equal K·M)     [−1]*G (single)
    batch   = refill_rounds(ctx, extras = {extra: intents})      (rollout/sample.py: B prompts, G rows)
    row j of a group samples under intent intents[j], with seed (seed, step, key, offset + j)

**Held-out evaluation** (``evaluate``, M4; greedy = the ODE from each row's own x_1, step −1's
noise; every held-out scene ``s`` gets ``eval_n`` rows)::

    best_of_N        = mean_s max_j r(s, j)   over rows under intents group_intents(K, N/K)
                       (eval_intents = "balanced": N split over the K intents, guided) or all −1 ("none")
    best_of_N_uncond = the same over N unconditional rows (intent −1)
    reward_mean_uncond = mean_s mean_j r(s, j) of those unconditional rows
    maneuver_entropy = mean_s H(histogram of the sector of each unconditional row's x_final)
                       H = −Σ_k p_k log p_k (nats) over ``sectors`` sectors of angle 2π/sectors
                       centred on 2πk/sectors: the spread of the unconditional policy's maneuvers

**Defaults**

- ``intents = 8``, ``per_intent = 2`` [PAPER-SUMMARY] "8 × 2" = 16 candidates per scene.
- ``mode = "multi"``; ``"single"`` with ``single_intent = -1`` [PAPER-SUMMARY] the paper's
  single-intent baseline (all samples from one intent or unconditional).
- ``extra = "intent"`` [INFERRED] the request extra the policy samples under.
- ``eval_n = 16``, ``eval_intents = "balanced"`` [PAPER-SUMMARY] best-of-16 split over the 8
  intents (the project page's "8 × 2"); ``sectors = 8`` [INFERRED] one maneuver per intent heading
  (0 = no entropy: a policy whose ``x_final`` is not a 2-D endpoint).

**Notes**

1. The policy must sample under ``extra`` (its ``condition_extras``): ``check_strategy`` refuses a
   policy/strategy pair that disagree (``collects``), and the strategy checks ``G = K·M`` at its
   first call.
2. The unconditional rows of ``evaluate`` sample with offsets ``eval_n ..`` so they are not the
   guided rows' x_1: each measure has its own noise, fixed across evaluations (step −1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from groupwise.errors import ConfigError
from groupwise.registry import register
from groupwise.rollout.context import RolloutContext
from groupwise.rollout.sample import refill_rounds
from groupwise.types import Request, Rollout, StepInfo

MODES = ("multi", "single")
EVAL_INTENTS = ("balanced", "none")


def group_intents(intents: int, per_intent: int) -> list[int]:
    """The intent of each row of an intent-balanced group: ``[0]*M + [1]*M + … + [K−1]*M``."""
    if intents < 1 or per_intent < 1:
        raise ValueError(f"group_intents: need intents >= 1 and per_intent >= 1, got {intents}, {per_intent}")
    return [k for k in range(intents) for _ in range(per_intent)]


def sector_entropy(points: torch.Tensor, valid: torch.Tensor, sectors: int) -> torch.Tensor:
    """[B] float64: the entropy (nats) of the histogram of the heading sectors of each group's valid
    points [B,G,2] (``valid`` [B,G]); sector k is centred on angle 2πk/sectors."""
    angle = torch.atan2(points[..., 1].double(), points[..., 0].double())  # [B,G]
    sector = torch.round(angle / (2 * math.pi / sectors)).long() % sectors  # [B,G]
    counts = torch.zeros(points.shape[0], sectors, dtype=torch.float64)  # [B,S]
    counts.scatter_add_(1, sector, valid.double())
    p = counts / counts.sum(1, keepdim=True).clamp(min=1)  # [B,S]
    return -(torch.where(p > 0, p * p.log(), torch.zeros(()))).sum(1)  # [B]


@register("rollout", "multi_intent")
@dataclass
class MultiIntent:
    """DIAL's intent-balanced groups (K intents × M rows), or single-intent GRPO (``mode = "single"``)."""

    intents: int = 8  # K [PAPER-SUMMARY] eight rule-derived driving intents
    per_intent: int = 2  # M [PAPER-SUMMARY] "8 × 2": two samples per intent
    mode: str = "multi"  # "multi" (every intent in every group) or "single" (the baseline)
    single_intent: int = -1  # mode single: the rows' intent (-1: the null condition, unconditional sampling)
    extra: str = "intent"  # the request extra (the policy's condition_extras name) the rows sample under
    eval_n: int = 16  # evaluate: rows per held-out scene (best-of-N) [PAPER-SUMMARY] 16 candidates
    eval_intents: str = "balanced"  # evaluate's best_of_N rows: "balanced" (N/K per intent) or "none" (unconditional)
    sectors: int = 8  # evaluate: heading sectors of the maneuver histogram (0 = no maneuver_entropy) [INFERRED]

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.eval_intents not in EVAL_INTENTS:
            raise ConfigError(
                f"rollout multi_intent: mode={self.mode!r} must be one of {MODES}, eval_intents="
                f"{self.eval_intents!r} one of {EVAL_INTENTS}"
            )
        if self.intents < 1 or self.per_intent < 1 or not -1 <= self.single_intent < self.intents:
            raise ConfigError(
                f"rollout multi_intent: need intents >= 1 ({self.intents}), per_intent >= 1 ({self.per_intent}) "
                f"and -1 <= single_intent < intents ({self.single_intent})"
            )
        if self.eval_n < 1 or (self.eval_intents == "balanced" and self.eval_n % self.intents) or self.sectors < 0:
            raise ConfigError(
                f"rollout multi_intent: eval_n={self.eval_n} must be >= 1 and, with eval_intents='balanced', a "
                f"multiple of intents={self.intents}; sectors={self.sectors} >= 0"
            )

    @property
    def collects(self) -> tuple[str, ...]:
        return (self.extra,)  # the request extra every row samples under (check_strategy)

    def _row_intents(self, group_size: int) -> list[int]:
        """The intent of each of the ``group_size`` rows of a training group (module Math)."""
        if self.mode == "single":
            return [self.single_intent] * group_size
        if group_size != self.intents * self.per_intent:
            raise ConfigError(
                f"rollout multi_intent: rollout.group_size={group_size} must equal intents × per_intent = "
                f"{self.intents} × {self.per_intent} = {self.intents * self.per_intent} (every intent M times)"
            )
        return group_intents(self.intents, self.per_intent)

    def __call__(self, ctx: RolloutContext) -> Rollout:
        return refill_rounds(ctx, extras={self.extra: self._row_intents(ctx.group_size)})

    def evaluate(self, ctx: RolloutContext, rows: list[dict], info: StepInfo) -> dict[str, float]:
        """The held-out best-of-N and maneuver spread (module docstring); ``ctx`` samples greedily."""
        n, keys = self.eval_n, range(len(rows))
        chosen = group_intents(self.intents, n // self.intents) if self.eval_intents == "balanced" else [-1] * n
        best = ctx.rollout([Request(key=i, n=n, extras={self.extra: chosen}) for i in keys])
        uncond = ctx.rollout([Request(key=i, n=n, offset=n, extras={self.extra: [-1] * n}) for i in keys])
        if best.rewards is None or uncond.rewards is None:
            raise ValueError("rollout multi_intent: evaluate needs scored rows (ctx.rollout sets rewards [B,G])")
        out = {
            f"best_of_{n}": float(best.rewards.max(1).values.mean()),  # mean over scenes of the best row
            f"best_of_{n}_uncond": float(uncond.rewards.max(1).values.mean()),
            "reward_mean_uncond": float(uncond.rewards.mean()),
        }
        if self.sectors:
            points = uncond.extras.get("x_final")
            if points is None or points.shape[-1] != 2:
                raise ValueError(
                    "rollout multi_intent: maneuver_entropy reads each row's 2-D endpoint x_final [B,G,2]; "
                    "set sectors = 0 for a policy without one"
                )
            out["maneuver_entropy"] = float(sector_entropy(points, uncond.group_valid, self.sectors).mean())
        return out
