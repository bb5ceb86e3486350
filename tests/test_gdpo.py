"""GDPO (normalise each reward within the group, then sum, then whiten): hand-worked numbers, the
collapse it fixes, and TRL 1.16's normalize_then_sum re-derived (max |Δ| asserted)."""

from __future__ import annotations

import math

import pytest
import torch

from groupwise.registry import build
from groupwise.types import Rollout, StepInfo

INFO = StepInfo(step=0, seed=0, max_new_tokens=4)


def rollout(parts, weights, valid=None):
    parts = torch.tensor(parts, dtype=torch.float32)  # [B,G,K]
    B, G, K = parts.shape
    w = torch.tensor(weights, dtype=torch.float32)  # [K]
    ro = Rollout(
        prompt_ids=[[1]] * B,
        actions=torch.ones(B, G, 2, dtype=torch.long),
        mask=torch.ones(B, G, 2, dtype=torch.bool),
        group_valid=torch.ones(B, G, dtype=torch.bool) if valid is None else torch.tensor(valid),
        truncated=torch.zeros(B, G, dtype=torch.bool),
        prompt_index=torch.arange(B),
    )
    ro.reward_parts = parts
    ro.rewards = torch.nansum(parts * w, dim=-1)  # [B,G] the weighted total (what the reward stage writes)
    ro.set_extra("reward_weights", w.expand(B, K).clone(), "group")
    return ro


def test_hand_worked_group():
    # r1 = [1,0,1,0]: mean 0.5, Bessel std sqrt(1/3) = 0.577350 → z1 = ±0.5 / 0.577450
    # r2 = [0,0,0,3]: mean 0.75, Bessel var (3·0.5625 + 5.0625)/3 = 2.25, std 1.5 →
    # z2 = [-0.75,-0.75,-0.75,2.25] / 1.5001
    z1 = [0.5 / (math.sqrt(1 / 3) + 1e-4) * s for s in (1, -1, 1, -1)]
    z2 = [v / 1.5001 for v in (-0.75, -0.75, -0.75, 2.25)]
    s = [a + b for a, b in zip(z1, z2)]  # weights 1, 1
    mean = sum(s) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in s) / 3)
    expected = [(x - mean) / (std + 1e-4) for x in s]
    adv = build("advantage", "gdpo")(rollout([[[1, 0], [0, 0], [1, 0], [0, 3]]], [1.0, 1.0]), INFO)
    assert adv[0].tolist() == pytest.approx(expected, rel=1e-6)
    raw = build("advantage", "gdpo", batch_norm=False)(rollout([[[1, 0], [0, 0], [1, 0], [0, 3]]], [1.0, 1.0]), INFO)
    assert raw[0].tolist() == pytest.approx(s, rel=1e-6)


def test_distinct_reward_combinations_keep_distinct_advantages():
    # two binary rewards; rows (1,0) and (0,1) both sum to 1, so GRPO gives them one advantage,
    # while reward 2 is rarer in this group, so GDPO credits its success more
    parts = [[[1, 0], [1, 0], [1, 0], [0, 1], [0, 0], [0, 0]]]
    grpo = build("advantage", "grpo")(rollout(parts, [1.0, 1.0]), INFO)[0]
    gdpo = build("advantage", "gdpo")(rollout(parts, [1.0, 1.0]), INFO)[0]
    assert grpo[0] == pytest.approx(grpo[3].item())
    assert gdpo[3] > gdpo[0] > 0 > gdpo[4]


def test_invalid_rows_and_missing_verdicts():
    nan = float("nan")
    parts = [[[1, 0], [0, nan], [1, 2], [0, 1]]]
    ro = rollout(parts, [1.0, 0.5], valid=[[True, True, True, False]])
    adv = build("advantage", "gdpo")(ro, INFO)
    assert adv[0, 3] == 0 and torch.isfinite(adv).all()
    # reward 2 has verdicts on rows 0 and 2 only (row 1 no verdict, row 3 invalid):
    # z2 = [-c, ·, +c] with c = 1/(sqrt(2) + 1e-4)
    raw = build("advantage", "gdpo", batch_norm=False)(ro, INFO)[0]
    c = 1.0 / (math.sqrt(2.0) + 1e-4)
    # r1 over rows 0-2: mean 2/3, Bessel std sqrt(1/3)
    z1 = [v / (math.sqrt(1 / 3) + 1e-4) for v in (1 / 3, -2 / 3, 1 / 3)]
    assert raw[:3].tolist() == pytest.approx([z1[0] - 0.5 * c, z1[1], z1[2] + 0.5 * c], rel=1e-5)


def test_matches_trl_normalize_then_sum():
    """TRL 1.16 (`multi_objective_aggregation="normalize_then_sum"`) re-derived: per-function nanmean /
    nanstd over each group, (x − mean)/(std + 1e-4), weighted nansum, then whitened over the batch."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    g = torch.Generator().manual_seed(0)
    B, G, K = 6, 8, 3
    parts = torch.randint(0, 3, (B, G, K), generator=g).float()  # [B,G,K]
    parts[0, 2, 1] = float("nan")
    weights = torch.tensor([1.0, 0.5, 2.0])
    ro = rollout(parts.tolist(), weights.tolist())
    ours = build("advantage", "gdpo")(ro, INFO).flatten()  # [B*G]
    mean_k = torch.nanmean(parts, dim=1, keepdim=True)  # [B,1,K]
    std_k = trl_utils.nanstd(parts, dim=1, keepdim=True)  # [B,1,K]
    total = (((parts - mean_k) / (std_k + 1e-4)) * weights).nansum(dim=-1).flatten()  # [B*G]
    theirs = (total - total.nanmean()) / (trl_utils.nanstd(total) + 1e-4)
    diff = (ours - theirs).abs().max().item()
    print(f"gdpo vs TRL normalize_then_sum: max |diff| {diff:.2e}")
    assert diff < 1e-5
