"""SLAS (specs/38): signed power of group-centred, batch-std-normalised rewards, worked by hand.

Spec unit test (population std over all B·G rows)::

    rewards = [[0,1,1,2],[3,3,3,5]]      group means 1, 3.5
    dr      = [[-1,0,0,1],[-.5,-.5,-.5,1.5]]
    Σ dr²   = 1 + 1 + 3·.25 + 2.25 = 5   → std = √(5/8) = .790569
    z       = dr/.790569 = [[-1.2649,0,0,1.2649],[-.6325,-.6325,-.6325,1.8974]]
    γ = 1:   z|z| = dr²/(5/8)·sign = [[-1.6,0,0,1.6],[-.4,-.4,-.4,3.6]]
    γ = .5:  |z|^1.5: 1.2649^1.5 = 1.4226, .6325^1.5 = .5030, 1.8974^1.5 = 2.6135
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, rollout_from, train_recorded

from groupwise.advantages.slas import slas_advantages
from groupwise.registry import build

SPEC = [[0.0, 1.0, 1.0, 2.0], [3.0, 3.0, 3.0, 5.0]]


def _ro(rewards, valid=None):
    r = torch.tensor(rewards, dtype=torch.float32)
    ro = rollout_from(torch.zeros(*r.shape, 2), None, rewards=r)
    if valid is not None:
        ro.group_valid = torch.tensor(valid, dtype=torch.bool)
    return ro


def _adv(rewards, valid=None, **params):
    return build("advantage", "slas", **params)(_ro(rewards, valid), info_for(2))


def _close(actual, expected, atol=1e-4):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_gamma_one():
    adv = _adv(SPEC, gamma=1.0)
    assert adv.dtype == torch.float32 and adv.shape == (2, 4)
    _close(adv, [[-1.6, 0, 0, 1.6], [-0.4, -0.4, -0.4, 3.6]])


def test_spec_gamma_half_default():
    _close(_adv(SPEC), [[-1.4226, 0, 0, 1.4226], [-0.5030, -0.5030, -0.5030, 2.6135]])


def test_gamma_zero_is_the_linear_batch_std_advantage():
    s = math.sqrt(5 / 8)  # .790569
    _close(_adv(SPEC, gamma=0.0), [[-1 / s, 0, 0, 1 / s], [-0.5 / s, -0.5 / s, -0.5 / s, 1.5 / s]])


def test_properties_sign_shrink_amplify_scale_free():
    lin, adv = _adv(SPEC, gamma=0.0), _adv(SPEC, gamma=0.5)
    assert torch.equal(adv.sign(), lin.sign())
    small, large = (lin.abs() < 1) & (lin != 0), lin.abs() > 1  # |z| = .6325 shrunk; 1.2649, 1.8974 amplified
    assert small.sum() == 3 and large.sum() == 3
    assert (adv.abs()[small] < lin.abs()[small]).all() and (adv.abs()[large] > lin.abs()[large]).all()
    torch.testing.assert_close(_adv([[10 * x for x in row] for row in SPEC]), adv, atol=1e-5, rtol=0)  # r → 10r


def test_unbiased_std_option():
    # Σ dr² = 5, n − 1 = 7 → z² = dr²·7/5 = 1.4·dr²; γ = 1: ±1.4, −.35 (.25·1.4), 3.15 (2.25·1.4)
    _close(_adv(SPEC, gamma=1.0, std="unbiased"), [[-1.4, 0, 0, 1.4], [-0.35, -0.35, -0.35, 3.15]])


def test_power_then_norm_by_hand():
    # γ = 1: p = dr|dr| = [-1,0,0,1,-.25,-.25,-.25,2.25]; mean p = 1.5/8 = .1875
    # p − mean = [-1.1875,-.1875,-.1875,.8125,-.4375×3,2.0625]
    # Σ (p − mean)² = 1.410156 + 2·.035156 + .660156 + 3·.191406 + 4.253906 = 6.96875 → std = √(6.96875/8) = .933324
    # adv = p/.933324 = ±1.07143, −.267857, 2.410714; r → 10r gives the same (p and std both ×100)
    want = [[-1.07143, 0, 0, 1.07143], [-0.267857, -0.267857, -0.267857, 2.410714]]
    _close(_adv(SPEC, gamma=1.0, order="power_then_norm"), want)
    _close(_adv([[10 * x for x in row] for row in SPEC], gamma=1.0, order="power_then_norm"), want)


# ---------------------------------------------------------------------------------------------- whole-batch statistic
def test_std_is_over_the_whole_batch():
    # group 1 alone: dr = [-.5,-.5,-.5,1.5], Σ dr² = 3, std = √(3/4) = .866025 → γ = 1: dr²/.75 = .3333, 3.0
    _close(_adv(SPEC[1:], gamma=1.0), [[-1 / 3, -1 / 3, -1 / 3, 3.0]])
    # beside group 0 the same rewards get −.4 / 3.6 (spec test): the std is the batch's, not the group's
    assert _adv(SPEC, gamma=1.0)[1, 3] == pytest.approx(3.6, abs=1e-4)


def test_constant_group_rows_count_in_the_batch_std():
    # [[0,1,1,2],[3,3,3,3]]: dr = [-1,0,0,1, 0,0,0,0]; Σ dr² = 2, n = 8 → std .5; z = ±2 → γ = 1: ±4
    adv = _adv([[0.0, 1.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]], gamma=1.0)
    _close(adv, [[-4.0, 0, 0, 4.0], [0, 0, 0, 0]])
    assert (adv[1] == 0).all()  # exactly 0, not rounding


# ---------------------------------------------------------------------------------------------- edge cases
def test_nan_reward_row_is_zero_and_out_of_the_statistics():
    # group 1 valid [3,3,5]: mean 11/3, dr = [-2/3, -2/3, 4/3]; batch n = 7,
    # Σ dr² = 2 + 4/9 + 4/9 + 16/9 = 42/9 → var = 2/3, std = .816497
    # γ = 1: dr²·1.5·sign = ±1.5; −(4/9)·1.5 = −2/3; (16/9)·1.5 = 8/3
    adv = _adv([[0.0, 1.0, 1.0, 2.0], [3.0, float("nan"), 3.0, 5.0]], gamma=1.0)
    _close(adv, [[-1.5, 0, 0, 1.5], [-2 / 3, 0, -2 / 3, 8 / 3]])
    assert adv[1, 1] == 0 and torch.isfinite(adv).all()


def test_invalid_rows_single_row_and_all_constant_batch():
    # group 0: row 3 invalid (reward 99 ignored) → [0,1,1]: mean 2/3, dr = [-2/3, 1/3, 1/3]
    # group 1: one valid row → constant → 0.   Σ dr² = 4/9 + 2/9 = 2/3, n = 4 → var 1/6
    # γ = 1: dr²·6·sign = −8/3, 2/3, 2/3
    adv = _adv([[0.0, 1.0, 1.0, 99.0], [5.0, 7.0, 8.0, 9.0]], valid=[[1, 1, 1, 0], [1, 0, 0, 0]], gamma=1.0)
    _close(adv, [[-8 / 3, 2 / 3, 2 / 3, 0], [0, 0, 0, 0]])
    assert adv[0, 3] == 0 and (adv[1] == 0).all()
    flat = _adv([[1.0, 1.0], [0.0, 0.0]])  # every group constant: std 0, no NaN
    assert torch.equal(flat, torch.zeros(2, 2))
    assert torch.equal(_adv([[1.0, float("nan")]], valid=[[0, 1]]), torch.zeros(1, 2))


def test_step_stats_and_errors():
    slas = build("advantage", "slas")
    slas(_ro(SPEC), info_for(2))
    stats = slas.step_stats()
    # 6 non-zero rows; |z| > 1 for 1.2649 (×2) and 1.8974 → 3/6
    assert stats["slas/batch_std"] == pytest.approx(math.sqrt(5 / 8)) and stats["slas/amplified_frac"] == pytest.approx(
        0.5
    )
    for bad in ({"gamma": -0.1}, {"order": "both"}, {"std": "sample"}, {"eps": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            build("advantage", "slas", **bad)


def test_function_matches_component():
    r = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).double()
    valid = torch.ones(3, 5, dtype=torch.bool)
    adv, std, amplified = slas_advantages(r, valid, gamma=0.7)
    ro = _ro(r.float().tolist())
    torch.testing.assert_close(
        build("advantage", "slas", gamma=0.7)(ro, info_for(2)), adv.float(), atol=1e-6, rtol=1e-6
    )
    assert 0 < int(amplified.sum()) < 15


# ---------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_on_the_embedded_model(tmp_path, objective):
    rows, seen = train_recorded(
        tmp_path, objective, 'advantage.estimator={name="slas", gamma=1.0}', "rollout.group_size=8"
    )
    for row, batch in zip(rows, seen):
        r, valid = batch.rewards.double(), batch.group_valid & torch.isfinite(batch.rewards)
        want, std, _ = slas_advantages(r, valid, gamma=1.0)
        torch.testing.assert_close(batch.advantages, want.float())  # the trainer's advantages are SLAS's
        assert row["slas/batch_std"] == pytest.approx(float(std))
        lin, _, _ = slas_advantages(r, valid, gamma=0.0)
        if lin.abs().max() > 0:  # a batch with signal: the power really changed it (|z|·|z| ≠ |z| off ±1)
            assert not torch.allclose(batch.advantages.double(), lin, atol=1e-3)
            assert 0 <= row["slas/amplified_frac"] <= 1
    assert any(float(b.advantages.abs().sum()) > 0 for b in seen)  # the comparison above ran at least once
