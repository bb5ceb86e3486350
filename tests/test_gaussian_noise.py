"""Reward ``gaussian_noise``: seeded per row, independent of the batch around it, 0 on invalid rows."""

from __future__ import annotations

import pytest
import torch
from helpers import info_for, make_rollout

from groupwise.registry import build
from groupwise.seeds import sample_seed


def test_each_row_is_sigma_times_its_own_seeded_normal():
    ro = make_rollout(B=2, G=3, T=2)
    ro.prompt_index = torch.tensor([5, 9])
    ro.group_valid[:] = True
    out = build("reward", "gaussian_noise", sigma=0.25).score_rollout(ro, info_for(2))  # [B,G]
    info = info_for(2)
    for b, pid in enumerate((5, 9)):
        for g in range(3):
            z = torch.randn((), generator=torch.Generator().manual_seed(sample_seed(info.seed, info.step, pid, g)))
            assert out[b, g].item() == pytest.approx(0.25 * z.item(), abs=1e-7)


def test_noise_does_not_depend_on_the_other_groups_and_invalid_rows_get_zero():
    noise = build("reward", "gaussian_noise", sigma=1.0)
    both = make_rollout(B=2, G=4, T=2)
    both.prompt_index = torch.tensor([3, 7])
    alone = make_rollout(B=1, G=4, T=2)
    alone.prompt_index = torch.tensor([7])
    both.group_valid[:] = True
    alone.group_valid[:] = True
    a = noise.score_rollout(both, info_for(2))  # [2,4]
    b = noise.score_rollout(alone, info_for(2))  # [1,4]
    torch.testing.assert_close(a[1], b[0], rtol=0, atol=0)
    both.group_valid[0, 1] = False
    assert noise.score_rollout(both, info_for(2))[0, 1].item() == 0.0


def test_many_rows_have_mean_zero_and_std_sigma():
    ro = make_rollout(B=500, G=8, T=1)
    ro.prompt_index = torch.arange(500)
    ro.group_valid[:] = True
    out = build("reward", "gaussian_noise", sigma=0.1).score_rollout(ro, info_for(1))  # [500,8]
    assert abs(float(out.mean())) < 0.1 * 4 / 4000**0.5  # 4 standard errors
    assert float(out.std()) == pytest.approx(0.1, rel=0.05)


def test_negative_sigma_is_refused():
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        build("reward", "gaussian_noise", sigma=-1.0)


def test_cauchy_is_a_ratio_of_two_seeded_normals_and_heavy_tailed():
    ro = make_rollout(B=500, G=8, T=1)
    ro.prompt_index = torch.arange(500)
    ro.group_valid[:] = True
    out = build("reward", "gaussian_noise", sigma=0.5, dist="cauchy").score_rollout(ro, info_for(1))  # [500,8]
    info = info_for(1)
    z = torch.randn(
        2, generator=torch.Generator().manual_seed(sample_seed(info.seed, info.step, 7, 3)), dtype=torch.float64
    )
    assert out[7, 3].item() == pytest.approx(0.5 * float(z[0] / z[1]), rel=1e-6)
    # standard Cauchy: median |ε| = 1 (tan(π/4)), P(|ε| > 10) = 1 − (2/π)·atan(10) = .063451
    assert float(out.abs().median()) == pytest.approx(0.5, rel=0.06)
    assert float((out.abs() > 5.0).float().mean()) == pytest.approx(0.063451, abs=0.015)
    with pytest.raises(ValueError, match="dist"):
        build("reward", "gaussian_noise", dist="laplace")
