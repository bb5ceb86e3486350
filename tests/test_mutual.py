"""Paper 52 Mutual RL: spec 52's numbers (XGRPO, SGT, PRP) and the strategy's exchange on hand-made batches.

The actor mechanism itself (two models sampling and training, resume) is tests/test_actors.py."""

from __future__ import annotations

import math

import pytest
import torch

from groupwise.registry import build
from groupwise.rollout.mutual import Mutual, pooled_stats, rescue_rows, sequence_logp, token_rows
from groupwise.types import INJECTED, Rollout, StepInfo
from groupwise.weights.peer_is import peer_weights

INFO = StepInfo(step=0, seed=0, max_new_tokens=4)


def batch(rewards: list[list[float]], T: int = 3) -> Rollout:
    B, G = len(rewards), len(rewards[0])
    ro = Rollout(
        prompt_ids=[[1, 2]] * B,
        actions=torch.ones(B, G, T, dtype=torch.long),
        mask=torch.ones(B, G, T, dtype=torch.bool),
        group_valid=torch.ones(B, G, dtype=torch.bool),
        truncated=torch.zeros(B, G, dtype=torch.bool),
        prompt_index=torch.arange(B),
    )
    ro.rewards = torch.tensor(rewards)
    return ro


def with_pool(ro: Rollout, mean: torch.Tensor, std: torch.Tensor) -> Rollout:
    ro.set_extra("pooled_mean", mean, "group")
    ro.set_extra("pooled_std", std, "group")
    return ro


def test_xgrpo_spec_numbers():
    # A [0,0,0,0], B [1,1,0,0]: pooled μ = 2/8 = 0.25, σ = sqrt(0.25·0.75) = 0.433013 (population)
    # A_A = (0 − 0.25)/0.433013 = −0.57735; A_B = (1 − 0.25)/0.433013 = 1.732051
    a, b = batch([[0, 0, 0, 0]]), batch([[1, 1, 0, 0]])
    mean, std = pooled_stats(a, b)
    assert mean.tolist() == [pytest.approx(0.25)] and std.tolist() == [pytest.approx(0.433013, abs=1e-6)]
    xgrpo = build("advantage", "xgrpo")
    adv_a = xgrpo(with_pool(a, mean, std), INFO)
    adv_b = xgrpo(with_pool(b, mean, std), INFO)
    torch.testing.assert_close(adv_a, torch.full((1, 4), -0.57735), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv_b, torch.tensor([[1.732051, 1.732051, -0.57735, -0.57735]]), atol=1e-5, rtol=0)
    # plain GRPO on A alone: all 0 (a constant group)
    assert build("advantage", "grpo")(a, INFO).abs().sum() == 0


def test_sgt_spec_numbers_over_the_augmented_group():
    # own [0,0,0,0] + 1 rescued success → [0,0,0,0,1]: μ = 0.2, σ = sqrt(0.2·0.8) = 0.4
    # → (0 − 0.2)/0.4 = −0.5 ×4 and (1 − 0.2)/0.4 = 2.0
    ro = batch([[0, 0, 0, 0, 1]])
    mean, std = pooled_stats(ro)
    ro.set_flag(INJECTED, torch.tensor([[False, False, False, False, True]]))
    adv = build("advantage", "xgrpo")(with_pool(ro, mean, std), INFO)
    torch.testing.assert_close(adv, torch.tensor([[-0.5, -0.5, -0.5, -0.5, 2.0]]), atol=1e-5, rtol=0)
    # λ_sgt = 0.5 halves the rescue row only
    half = build("advantage", "xgrpo", lambda_sgt=0.5)(ro, INFO)
    torch.testing.assert_close(half, torch.tensor([[-0.5, -0.5, -0.5, -0.5, 1.0]]), atol=1e-5, rtol=0)
    # the same as grpo with the population std (the extras are the group's own)
    grpo = build("advantage", "grpo", std="population", eps=1e-6)(ro, INFO)
    torch.testing.assert_close(adv, grpo, atol=1e-6, rtol=0)


def test_prp_spec_weight():
    # own seq log-prob −3, peer −5 → w = min(2, e^(−3 − (−5))) = min(2, e² = 7.39) = 2
    assert peer_weights(torch.tensor(-3.0), torch.tensor(-5.0), 2.0).item() == 2.0
    # own −5, peer −3 → e^−2 = 0.135335 (below C: untouched)
    assert peer_weights(torch.tensor(-5.0), torch.tensor(-3.0), 2.0).item() == pytest.approx(math.exp(-2))


def test_peer_is_weights_injected_rows_only():
    ro = batch([[1, 0]], T=2)
    ro.logp_old = torch.tensor([[[-1.0, -2.0], [-2.0, -3.0]]])  # [1,2,2] row sums −3, −5
    ro.set_flag(INJECTED, torch.tensor([[False, True]]))
    ro.set_extra("behav_seq_logp", torch.tensor([[0.0, -4.0]]), "row")
    w = build("weight", "peer_is")(ro, INFO)  # [1,2,2]
    # own row: 1; injected: min(2, e^(−5 − (−4))) = e^−1 = 0.367879 on both tokens
    torch.testing.assert_close(w, torch.tensor([[[1.0, 1.0], [math.exp(-1), math.exp(-1)]]]))
    weight = build("weight", "peer_is")
    ro.set_flag(INJECTED, torch.tensor([[True, True]]))
    ro.set_extra("behav_seq_logp", torch.tensor([[-5.0, -4.0]]), "row")
    weight(ro, INFO)
    # w = [min(2, e²) = 2, e^−1 = 0.367879]: population variance ((2 − 0.367879)/2)² = 0.666050
    assert weight.step_stats()["mutual/prp_is_var"] == pytest.approx(((2 - math.exp(-1)) / 2) ** 2, rel=1e-6)


def test_sgt_gate_and_token_rows():
    # group 0: receiver failed, peer has successes at rows 1, 2 → the first (k = 1); group 1: receiver
    # succeeded → no rescue; group 2: both failed → none
    own = batch([[0, 0], [1, 0], [0, 0]])
    peer = batch([[0, 1, 1], [1, 1, 1], [0, 0, 0]])
    assert rescue_rows(own, peer, 1.0, 1) == {0: [1]}
    assert rescue_rows(own, peer, 1.0, 2) == {0: [1, 2]}
    rows = token_rows(own, [0, 2], [[[5, 6, 0]], [[7, 0], [8, 9, 9, 0]]])
    assert rows.shape == (2, 2, 4) and rows.group_valid.tolist() == [[True, False], [True, True]]
    assert rows.actions[1, 1].tolist() == [8, 9, 9, 0] and rows.mask[0, 0].tolist() == [True, True, True, False]
    assert rows.prompt_index.tolist() == [0, 2]
    peer.logp_sampler = torch.tensor([[[-1.0, -1.0, -1.0]] * 3] * 3)
    assert sequence_logp(peer)[0].tolist() == [-3.0, -3.0, -3.0]


def test_mutual_refuses_unknown_share():
    from groupwise.errors import ConfigError

    with pytest.raises(ConfigError, match="share='both'; one of none, xgrpo, prp, sgt"):
        Mutual(share="both")
