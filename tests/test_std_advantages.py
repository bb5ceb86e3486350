"""REINFORCE++ (+baseline), OPO and GPG advantages worked by hand, and against verl's loops
(verl/trainer/ppo/core_algos.py compute_*_outcome_advantage, re-derived here as per-row loops)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, make_rollout, rollout_from

from groupwise.registry import build


def _rollout(rewards, lengths, T=4):
    r = torch.tensor(rewards, dtype=torch.float32)  # [B,G]
    L = torch.tensor(lengths)  # [B,G]
    mask = torch.arange(T) < L[..., None]  # [B,G,T]
    return rollout_from(torch.zeros(*r.shape, T), None, mask=mask, rewards=r)


def test_reinforce_pp_baseline_by_hand():
    # one group r = [1, 0], lengths [2, 1]: centred [0.5, -0.5]; tokens 0.5, 0.5, -0.5 (3 tokens)
    # mean 1/6; deviations 1/3, 1/3, -2/3; unbiased var (1/9+1/9+4/9)/2 = 1/3; std 0.57735
    adv = build("advantage", "reinforce_pp_baseline")(_rollout([[1.0, 0.0]], [[2, 1]]), info_for(4))
    s = math.sqrt(1 / 3 + 1e-8)
    torch.testing.assert_close(adv[0, 0, :2], torch.full((2,), (1 / 3) / s))
    assert adv[0, 1, 0].item() == pytest.approx((-2 / 3) / s, rel=1e-6)
    assert (adv[0, 0, 2:] == 0).all() and (adv[0, 1, 1:] == 0).all()


def test_reinforce_pp_discounted_return_by_hand():
    # rows r = [1, 0] with lengths [3, 1], gamma 0.5: returns 0.25, 0.5, 1 and 0
    # mean 1.75/4 = 0.4375; deviations -0.1875, 0.0625, 0.5625, -0.4375; Σd² = 0.546875; var 0.546875/3 = 0.18229167
    adv = build("advantage", "reinforce_pp", gamma=0.5)(_rollout([[1.0, 0.0]], [[3, 1]]), info_for(4))
    s = math.sqrt(0.546875 / 3 + 1e-8)
    torch.testing.assert_close(adv[0, 0, :3], torch.tensor([-0.1875, 0.0625, 0.5625]) / s)
    assert adv[0, 1, 0].item() == pytest.approx(-0.4375 / s, rel=1e-6)


def test_opo_length_weighted_baseline_by_hand():
    # r = [1, 0, 1], L = [1, 3, 2]: b = (1·1 + 3·0 + 2·1) / 6 = 0.5 → adv [0.5, -0.5, 0.5]
    # second group: the NaN row is excluded (advantage 0) and does not enter the baseline
    adv = build("advantage", "opo")(
        _rollout([[1.0, 0.0, 1.0], [0.7, float("nan"), 0.2]], [[1, 3, 2], [2, 2, 2]]), info_for(4)
    )
    torch.testing.assert_close(adv[0], torch.tensor([0.5, -0.5, 0.5]))
    # group 2: rows 0 and 2 valid: b = (2·0.7 + 2·0.2)/4 = 0.45 → [0.25, 0, -0.25]
    torch.testing.assert_close(adv[1], torch.tensor([0.25, 0.0, -0.25]))


def test_gpg_alpha_by_hand():
    # 2 groups × 2 rows, r = [[1, 0], [0, 0]]: N = 4 valid rows, M = 1 non-zero → alpha 4
    # group 1 centred [0.5, -0.5] → [2, -2]; group 2 constant → 0
    adv = build("advantage", "gpg")(_rollout([[1.0, 0.0], [0.0, 0.0]], [[1, 1], [1, 1]]), info_for(4))
    torch.testing.assert_close(adv, torch.tensor([[2.0, -2.0], [0.0, 0.0]]))


def _verl_loops(name, rewards, lengths, gamma=1.0):
    """verl's per-row loops on flattened rows (index = group id), all rows valid."""
    B, G = rewards.shape
    T = int(lengths.max())
    rows = [(b, g) for b in range(B) for g in range(G)]
    mask = torch.zeros(len(rows), T)
    tok = torch.zeros(len(rows), T)
    for i, (b, g) in enumerate(rows):
        mask[i, : lengths[b, g]] = 1
        tok[i, lengths[b, g] - 1] = rewards[b, g]  # the outcome reward on the last token
    scores = tok.sum(-1)
    groups = {}
    for i, (b, _) in enumerate(rows):
        groups.setdefault(b, []).append(i)

    def whiten(x):
        n = mask.sum()
        mean = (x * mask).sum() / n
        var = (((x - mean) ** 2) * mask).sum() / n * n / (n - 1)
        return (x - mean) * torch.rsqrt(var + 1e-8) * mask

    if name == "reinforce_pp":
        returns = torch.zeros_like(tok)
        running = torch.zeros(len(rows))
        for t in reversed(range(T)):
            running = tok[:, t] + gamma * running
            returns[:, t] = running
            running = running * mask[:, t]
        return whiten(returns)
    if name == "reinforce_pp_baseline":
        out = scores.clone()
        for idx in groups.values():
            out[idx] = scores[idx] - (scores[idx].mean() if len(idx) > 1 else 0.0)
        return whiten(out[:, None].expand(-1, T) * mask)
    if name == "opo":
        L = mask.sum(-1)
        out = scores.clone()
        for idx in groups.values():
            out[idx] = scores[idx] - ((L[idx] * scores[idx]).sum() / L[idx].sum() if len(idx) > 1 else 0.0)
        return out[:, None] * mask
    if name == "gpg":
        alpha = len(rows) / max(int(torch.count_nonzero(scores)), 1)
        out = scores.clone()
        for idx in groups.values():
            out[idx] = alpha * (scores[idx] - (scores[idx].mean() if len(idx) > 1 else 0.0))
        return out[:, None] * mask


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline", "opo", "gpg"])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_verl(name, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (4, 5), generator=g).float() / 2  # [B,G] in {0, .5, 1}
    lengths = torch.randint(1, 6, (4, 5), generator=g)  # [B,G]
    ours = build("advantage", name)(_rollout(rewards.tolist(), lengths.tolist(), T=5), info_for(5))
    theirs = _verl_loops(name, rewards, lengths).view(4, 5, -1)  # [B,G,T]
    if ours.dim() == 2:
        theirs = theirs[..., 0]  # a sequence advantage: verl broadcasts it over the tokens
    diff = float((ours - theirs[..., : ours.shape[-1]] if ours.dim() == 3 else ours - theirs).abs().max())
    print(f"{name} seed {seed}: max |ours − verl| = {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline", "opo", "gpg"])
def test_invalid_rows_are_zero_and_outputs_finite(name):
    ro = make_rollout(3, 4, 5, seed=2)
    adv = build("advantage", name)(ro, info_for(5))
    excluded = ~ro.group_valid | ~torch.isfinite(ro.rewards)  # [B,G]
    assert torch.isfinite(adv).all() and (adv[excluded] == 0).all()
