"""PAIR's per-turn advantage: the turn's reward centred in its own trajectory plus the trajectory's group advantage.

"PAIR: Prefix-Aware Internal Reward" (dense turn-level reward from the agent's own internals),
2026, https://arxiv.org/abs/2605.17877 — spec 03 (authors' ``compute_rewards_and_advantages``,
``grpo/training/grpo_loop.py``, through the spec).

**Change vs GRPO**: token advantages [B,G,T] instead of one per row: every token of turn t gets
``A_t = (r_t − mean_t r) + adv``, where ``adv`` is the row's group-normalised total reward
(population std; no eps, only the mean is subtracted when the std vanishes). The turn rewards
``r_t`` come from the ``pair`` reward (extra ``pair_turn_reward``, ``rewards/pair.py``).

**Math** (row = one trajectory of ``n`` turns; ``R`` = ``rollout.rewards``, the run's weighted
total: ``Σ_t r_t`` when ``pair`` is the only weighted reward)::

    adv      = (R − mean_g R) / std_g R    if std_g R > eps   else   R − mean_g R      # [B,G]
    A[b,g,t] = (r_turn(t) − mean_turns r) + adv                  on the row's turn tokens  # [B,G,T]

**Defaults**

- ``eps = 1e-8`` [CODE] ``std <= 1e-8``: subtract the mean only; population std [CODE] (numpy).

**Notes**

1. Turns are ``rewards.pair.turn_spans``: the segments of ``rollout.segment_id`` within
   ``row_mask``, or without segments the maximal runs of ``row_mask``; ``r_t`` is entry t of the
   segment extra. A rollout without the extra (no ``pair`` reward) has no
   per-turn rewards: each row is then one turn with ``r_0 = R``, so ``A`` is the group-normalised
   total on every token (GRPO with population std and this eps), which keeps the estimator usable
   with any reward [INFERRED].
2. Invalid rows (``group_valid`` False, NaN reward) get exactly 0 and enter no statistic; tokens
   outside ``row_mask`` (padding, environment holes) get exactly 0. A constant group has
   ``adv = 0``; its rows keep only the centred turn parts.
3. float64 statistics, float32 output saturating at float32's largest (``masked.to_float32``).
4. ``pair_turn_advantages`` is the spec's list interface (turn rewards of the G trajectories of
   one prompt -> per-turn advantages), the same maths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupwise.errors import ConfigError
from groupwise.masked import group_center, group_std, to_float32, valid_rows
from groupwise.registry import register
from groupwise.rewards.pair import TURN_REWARD, turn_spans
from groupwise.types import Rollout, StepInfo


def _group_advantage(R: Tensor, valid: Tensor, eps: float) -> Tensor:
    """[B,G] float64 (R − mean) / std (population), or R − mean where std <= eps."""
    centred = group_center(R, valid)  # [B,G]
    std = group_std(R, valid, ddof=0)  # [B,1]
    return torch.where(std > eps, centred / std.clamp(min=eps if eps > 0 else 1e-300), centred)  # [B,G]


def pair_turn_advantages(turn_rewards: list[list[float]], eps: float = 1e-8) -> list[list[float]]:
    """Per-turn advantages of the G trajectories of one prompt from their turn rewards."""
    R = torch.tensor([[sum(r) for r in turn_rewards]], dtype=torch.float64)  # [1,G]
    adv = _group_advantage(R, torch.ones_like(R, dtype=torch.bool), eps)[0].tolist()  # [G]
    return [[x - sum(r) / len(r) + a for x in r] for r, a in zip(turn_rewards, adv)]


@register("advantage", "pair")
@dataclass
class PairAdvantage:
    """Per-turn advantage (r_t − mean_t r) + group-normalised total reward (PAIR)."""

    group_relative = True  # needs G >= 2 for the group part
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not self.eps >= 0:
            raise ConfigError(f"advantage pair: eps must be >= 0, got {self.eps}")

    def __call__(self, rollout: Rollout, info: StepInfo) -> Tensor:
        R, valid = valid_rows(rollout)  # [B,G] float64, [B,G]
        adv = _group_advantage(R, valid, self.eps)  # [B,G]
        B, G, T = rollout.shape
        row_mask = rollout.row_mask.bool() & valid[..., None]  # [B,G,T]
        out = torch.where(row_mask, adv[..., None], torch.zeros((), dtype=torch.float64))  # [B,G,T]
        turns = rollout.extras.get(TURN_REWARD)  # [B,G,S] r_t of turn t, or None (Note 1)
        if turns is not None:
            turns = turns.double()  # [B,G,S]
            for b, g in valid.nonzero().tolist():
                spans = turn_spans(row_mask[b, g], rollout.segment_id[b, g] if rollout.segment_id is not None else None)
                if not spans:
                    continue
                r = turns[b, g, : len(spans)]  # [n]
                centred = r - r.mean()  # [n]
                for (s, e), c in zip(spans, centred):
                    out[b, g, s:e] += c
        return to_float32(out)  # [B,G,T]
