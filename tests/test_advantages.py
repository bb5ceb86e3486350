"""Advantage estimators worked by hand. Std convention is stated per test (unbiased = Bessel,
as torch.std / TRL / verl; population = numpy)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, rollout_from

from groupwise.advantages.sign import degeneracy_rate, iid_degeneracy
from groupwise.registry import build

NAN = float("nan")


def _ro(rewards, valid=None):
    r = torch.tensor(rewards, dtype=torch.float32)
    B, G = r.shape
    ro = rollout_from(torch.zeros(B, G, 2), None, rewards=r)
    if valid is not None:
        ro.group_valid = torch.tensor(valid, dtype=torch.bool)
    return ro


def _adv(name, rewards, valid=None, **params):
    return build("advantage", name, **params)(_ro(rewards, valid), info_for(2))


# ---------------------------------------------------------------------------------------------- grpo
def test_grpo_group_unbiased_by_hand():
    # r = [1,0,0,0]: mean 0.25; unbiased var = (0.75² + 3·0.25²)/3 = 0.75/3 = 0.25 → std 0.5
    # A = (r − 0.25)/(0.5 + 1e-4) = [1.49970, −0.49990, …]
    adv = _adv("grpo", [[1, 0, 0, 0]])
    torch.testing.assert_close(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / 0.5001)
    assert adv.dtype == torch.float32


def test_grpo_population_std():
    # population var = 0.75/4 = 0.1875 → std 0.4330127; A = 0.75/0.4331127 = 1.731651
    adv = _adv("grpo", [[1, 0, 0, 0]], std="population")
    torch.testing.assert_close(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (math.sqrt(0.1875) + 1e-4))


def test_grpo_batch_scale_and_none():
    # batch values [1,0,3,3]: mean 1.75, Σ dev² = 0.5625+3.0625+1.5625+1.5625 = 6.75, /3 = 2.25 → std 1.5
    # group-centred: [0.5, −0.5], [0, 0] → A = ±0.5/1.5001 = ±0.33331
    adv = _adv("grpo", [[1, 0], [3, 3]], scale="batch")
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5], [0.0, 0.0]]) / 1.5001)
    torch.testing.assert_close(_adv("grpo", [[1, 0], [3, 3]], scale="none"), torch.tensor([[0.5, -0.5], [0.0, 0.0]]))


def test_grpo_eps_verl():
    # eps 1e-6 (verl): r = [2, 0] → mean 1, unbiased std √2 → A = ±1/(1.414214 + 1e-6) = ±0.707106
    adv = _adv("grpo", [[2, 0]], eps=1e-6)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0]]) / (math.sqrt(2) + 1e-6))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("eps", [1e-4, 0.0])
def test_grpo_constant_single_and_empty_groups_are_exactly_zero(scale, eps):
    rewards = [[0.9, 0.9, 0.9], [0.7, 5.0, -2.0], [1.0, 2.0, 3.0], [0.3, 0.3, 0.9]]
    valid = [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 1]]
    adv = _adv("grpo", rewards, valid, scale=scale, eps=eps)
    assert torch.isfinite(adv).all()
    assert (adv[:3] == 0).all()  # constant (float32 0.9 − mean(0.9,0.9,0.9) = 6e-8, forced to 0); single; empty
    assert (adv[3] != 0).all()


def test_grpo_nan_rewards_excluded():
    # r = [1, NaN, 0, 0] → statistics over [1,0,0]: mean 1/3, unbiased std √((4/9 + 2/9)/2) = √(1/3) = 0.57735
    adv = _adv("grpo", [[1, NAN, 0, 0]])
    s = math.sqrt(1 / 3) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([[(2 / 3) / s, 0.0, (-1 / 3) / s, (-1 / 3) / s]]))


def test_grpo_invalid_rows_do_not_enter_statistics():
    # row 3 invalid (reward 100 ignored): same as r = [1,0,0] above
    adv = _adv("grpo", [[1, 0, 0, 100]], valid=[[1, 1, 1, 0]])
    s = math.sqrt(1 / 3) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([[(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0]]))


@pytest.mark.parametrize("params", [{"scale": "global"}, {"std": "biased"}, {"eps": -1.0}])
def test_grpo_rejects_bad_options(params):
    with pytest.raises(ValueError):
        build("advantage", "grpo", **params)


# ---------------------------------------------------------------------------------------------- dr_grpo
def test_dr_grpo_by_hand():
    # r − mean, no std: [1,0,0,0] → [0.75, −0.25, −0.25, −0.25];
    # specs/48: [[0,0,0,0],[1,1,0,0]] → [[0]*4, [.5,.5,−.5,−.5]]
    torch.testing.assert_close(_adv("dr_grpo", [[1, 0, 0, 0]]), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))
    torch.testing.assert_close(
        _adv("dr_grpo", [[0, 0, 0, 0], [1, 1, 0, 0]]), torch.tensor([[0.0] * 4, [0.5, 0.5, -0.5, -0.5]])
    )
    # NaN excluded: [2, NaN, 0] → mean 1 → [1, 0, −1]
    torch.testing.assert_close(_adv("dr_grpo", [[2, NAN, 0]]), torch.tensor([[1.0, 0.0, -1.0]]))


# ---------------------------------------------------------------------------------------------- rloo
def test_rloo_by_hand():
    # [1,0,0,0]: A_0 = 1 − mean(0,0,0) = 1; A_1 = 0 − mean(1,0,0) = −1/3  (= 4/3 · (r − 0.25))
    torch.testing.assert_close(_adv("rloo", [[1, 0, 0, 0]]), torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))
    # two valid rows: [2, 0] → [2 − 0, 0 − 2] = [2, −2]
    torch.testing.assert_close(_adv("rloo", [[2, 0]]), torch.tensor([[2.0, -2.0]]))
    # NaN excluded: [3, NaN, 1, 2] → n = 3: A = [3 − 1.5, 0, 1 − 2.5, 2 − 2] = [1.5, 0, −1.5, 0]
    torch.testing.assert_close(_adv("rloo", [[3, NAN, 1, 2]]), torch.tensor([[1.5, 0.0, -1.5, 0.0]]))


def test_rloo_degenerate_groups():
    adv = _adv("rloo", [[5.0, 1.0], [0.3, 0.3], [1.0, 2.0]], valid=[[1, 0], [1, 1], [0, 0]])
    assert torch.equal(adv, torch.zeros(3, 2))  # single valid row → no baseline → 0; constant; empty


def test_rloo_is_unbiased_leave_one_out():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(5, 6, generator=g)
    adv = build("advantage", "rloo")(rollout_from(torch.zeros(5, 6, 1), None, rewards=r), info_for(1))
    loo = torch.stack([r[:, i] - torch.cat([r[:, :i], r[:, i + 1 :]], 1).mean(1) for i in range(6)], 1)
    torch.testing.assert_close(adv, loo)


# ---------------------------------------------------------------------------------------------- sign
def test_sign_spec_48_unit_test():
    # specs/48: rewards [[0,0,0,0],[1,1,0,0]] → sign [[−1,−1,−1,−1],[1,1,−1,−1]]
    adv = _adv("sign", [[0, 0, 0, 0], [1, 1, 0, 0]])
    torch.testing.assert_close(adv, torch.tensor([[-1.0] * 4, [1.0, 1.0, -1.0, -1.0]]))
    # non-binary r ∈ [0,1]: 2r − 1 = 0 at r = 0.5; NaN / invalid rows → 0
    torch.testing.assert_close(_adv("sign", [[0.5, NAN, 1.0]], valid=[[1, 1, 0]]), torch.tensor([[0.0, 0.0, 0.0]]))
    torch.testing.assert_close(_adv("sign", [[0.25, 0.75]]), torch.tensor([[-0.5, 0.5]]))


def test_sign_degeneracy_numbers():
    assert degeneracy_rate(torch.tensor([[0.0, 0, 0, 0], [1, 1, 0, 0]])) == 0.5
    # NaN rewards are ignored; an all-NaN group is not counted; a single finite reward is degenerate
    assert degeneracy_rate(
        torch.tensor([[1.0, NAN, 1, 1], [NAN, NAN, NAN, NAN], [0, 1, NAN, 1], [NAN, 1, NAN, NAN]])
    ) == pytest.approx(2 / 3)
    # half the prompts p = 0.2, half p = 0.8, G = 4: D = 0.2⁴ + 0.8⁴ = 0.0016 + 0.4096 = 0.4112 (both halves)
    D = 0.5 * iid_degeneracy(0.2, 4) + 0.5 * iid_degeneracy(0.8, 4)
    assert D == pytest.approx(0.4112)
    # iid prediction at p̄ = 0.5: 2·0.5⁴ = 0.125 ≤ D (Jensen)
    assert iid_degeneracy(0.5, 4) == pytest.approx(0.125) and D >= iid_degeneracy(0.5, 4)
    # the "81 %" of specs/48: p = 0.05, G = 4 → 0.95⁴ + 0.05⁴ = 0.814506
    assert iid_degeneracy(0.05, 4) == pytest.approx(0.95**4 + 0.05**4)


def test_sign_gives_gradient_on_degenerate_groups_where_grpo_does_not():
    rewards = [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert (_adv("grpo", rewards) == 0).all()
    assert (_adv("sign", rewards).abs() == 1).all()
