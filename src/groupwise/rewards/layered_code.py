"""Layered compile/semantic reward for agentic code repair (spec 50, reward layer).

"Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair", arXiv 2605.07276,
https://arxiv.org/abs/2605.07276 (spec: specs/50; abstract only, no code).

**Change vs GRPO**: the outcome reward gets a middle tier. A binary pass/fail reward gives the same
0 to a repair that compiles but fails the semantic test and to one that does not compile; the
layered reward puts the compile-only repair between them, so a group where nothing passes but some
rollouts compile still has a reward spread (a non-zero group-relative advantage).

**Math** (row (b, g); ``compiled``/``semantic`` from the env's episode facts
``info[b][g]["env"]``, the last program state)::

    layered_reward(compiled, semantic, r_mid) = 1      if compiled and semantic
                                              = r_mid  if compiled and not semantic
                                              = 0      otherwise

**Defaults**

- ``r_mid = 0.5`` [INFERRED] spec 50's middle tier ("compile-and-semantic layered rewards"
  [ABSTRACT]; the value is the spec's guess). ``r_mid = 0`` is the binary reward (the abstract's
  ablation "binary reward removes the compile-only middle tier").
- ``weight = 1.0`` [INFERRED] the reward as is. In an env run put it next to
  ``{name = "env_return", weight = 0.0}`` (the env strategies need that column; its mean is still
  logged as ``reward/env_return``, the success rate).

**Notes**

1. A *rollout scorer* (``score_rollout``), so it runs on the whole batch an env strategy
   assembled; it reads only ``rollout.info`` (no model outputs, no needs).
2. A row without episode facts (no ``env`` dict, or one lacking ``compiled``/``semantic``) and
   padding rows (``group_valid`` False) score NaN: no verdict, excluded and counted, never 0.
3. ``semantic`` without ``compiled`` cannot happen in ``compile_fix``; it is scored 0 (a semantic
   pass of code that does not compile is not a pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.registry import register
from groupwise.types import Rollout, StepInfo


def layered_reward(compiled: Tensor, semantic: Tensor, r_mid: float = 0.5) -> Tensor:
    """rewards [B,G] float32 from ``compiled`` [B,G] bool and ``semantic`` [B,G] bool."""
    c, s = compiled.bool(), semantic.bool()  # [B,G], [B,G]
    out = torch.where(c & s, 1.0, torch.where(c, float(r_mid), 0.0))  # [B,G]
    return out.float()


def episode_flags(rollout: Rollout, key: str) -> Tensor:
    """[B,G] float: the episode fact ``key`` of each row as 0/1, NaN where the row has none."""
    B, G, _ = rollout.shape
    out = torch.full((B, G), float("nan"))  # [B,G]
    for b, row in enumerate(rollout.info or []):
        for g, item in enumerate(row[:G]):
            facts = (item or {}).get("env") if isinstance(item, dict) else None
            if isinstance(facts, dict) and key in facts:
                out[b, g] = float(bool(facts[key]))
    return out  # [B,G]


@register("reward", "layered_code")
@dataclass
class LayeredCode:
    """0 / r_mid / 1 for does-not-compile / compiles only / compiles and passes (spec 50's layered reward)."""

    r_mid: float = 0.5
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.r_mid <= 1.0:
            raise ValueError(f"layered_code: r_mid must be in [0, 1] (0 = the binary reward), got {self.r_mid!r}")

    def score_rollout(self, rollout: Rollout, info: StepInfo) -> Tensor:
        compiled, semantic = episode_flags(rollout, "compiled"), episode_flags(rollout, "semantic")  # [B,G], [B,G]
        known = torch.isfinite(compiled) & torch.isfinite(semantic) & rollout.group_valid  # [B,G]
        r = layered_reward(compiled.nan_to_num(0.0) > 0, semantic.nan_to_num(0.0) > 0, self.r_mid)  # [B,G]
        return torch.where(known, r, torch.full_like(r, float("nan")))  # [B,G]
