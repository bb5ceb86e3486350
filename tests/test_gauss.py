"""The shared Gaussian kernels (issue 37 M3): ``gauss_logp``, classifier-free guidance, Flow-GRPO's
noise schedule and the consistency kernel, checked against the specs' hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from groupwise.modalities.flow_sde import consistency_step, flow_grpo_noise_std, sde_step_with_logprob
from groupwise.modalities.gauss import cfg_velocity, gauss_logp


def test_gauss_logp_by_hand():
    # spec 10: a = 0.5, μ = 0.2, σ = 0.5: −0.3²/(2·0.25) − log 0.5 − ½ log 2π = −0.18 + 0.693147 − 0.918939
    new = gauss_logp(torch.tensor([[0.5]]), torch.tensor([[0.2]]), 0.5)
    assert float(new) == pytest.approx(-0.405792, abs=1e-6)
    # the old μ = 0: −0.5 + 0.693147 − 0.918939 = −0.725792; ratio exp(0.32) = 1.377128
    old = gauss_logp(torch.tensor([[0.5]]), torch.tensor([[0.0]]), 0.5)
    assert float(old) == pytest.approx(-0.725792, abs=1e-6)
    assert float(torch.exp(new - old)) == pytest.approx(1.377128, abs=1e-6)
    # spec 26: μ = [0,0], x' = [0.1,−0.2], σ = 0.5: per dim −0.02 / −0.08, + 0.693147 − 0.918939 each:
    # sum −0.245792 − 0.305792 = −0.551584; mean −0.275792
    x, mu = torch.tensor([[0.1, -0.2]], dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    assert float(gauss_logp(x, mu, 0.5, reduce="sum")) == pytest.approx(-0.55158, abs=1e-5)
    assert float(gauss_logp(x, mu, 0.5)) == pytest.approx(-0.275792, abs=1e-6)
    with pytest.raises(ValueError, match="reduce must be one of"):
        gauss_logp(x, mu, 0.5, reduce="max")


def test_cfg_velocity_by_hand():
    # spec 26: v_u = [0,0], v_c = [1,2]: w = 2 → [2,4]; w = 1 → v_c; w = 0 → v_u
    v_u, v_c = torch.tensor([0.0, 0.0]), torch.tensor([1.0, 2.0])
    assert cfg_velocity(v_u, v_c, 2.0).tolist() == [2.0, 4.0]
    assert torch.equal(cfg_velocity(v_u, v_c, 1.0), v_c) and torch.equal(cfg_velocity(v_u, v_c, 0.0), v_u)


def test_flow_grpo_noise_schedule_and_sde_mean_by_hand():
    # spec 45: σ = 0.5, σ' = 0.25 (dt = −0.25), a = 0.7: std_t = 0.7·√(0.5/0.5) = 0.7; x = 1, v = −1:
    # μ = 1·(1 − 0.49·0.25) + (−1)·(1 + 0.49·0.5/1)·(−0.25) = 0.8775 + 0.31125 = 1.18875
    x, v = torch.tensor([[1.0]], dtype=torch.float64), torch.tensor([[-1.0]], dtype=torch.float64)
    _, _, mean, std, *_ = sde_step_with_logprob(
        v, x, 0.5, 0.25, 0.0, 0.9, noise=torch.zeros(1, 1), schedule="flow_grpo"
    )
    assert float(std) == pytest.approx(0.7, abs=1e-12) and float(mean) == pytest.approx(1.18875, abs=1e-12)
    # σ = 1: the released code puts σ_max (0.9) in the denominator: 0.7·√(1/0.1) = 2.213594
    assert float(flow_grpo_noise_std(torch.tensor(1.0, dtype=torch.float64), 0.9)) == pytest.approx(
        0.7 * math.sqrt(10), abs=1e-12
    )


def test_consistency_step_by_hand():
    # t = 0.5, s = 0.25, x = [1,0], v = [0,−2]: x̂₀ = [1,0] − 0.5·[0,−2] = [1,1]; mean = 0.75·[1,1];
    # ε = [1,−1]: x_s = [0.75 + 0.25, 0.75 − 0.25] = [1, 0.5]; per dim −0.25²/(2·0.25²) − log 0.25 − ½ log 2π
    # = −0.5 + 1.386294 − 0.918939 = −0.032645 (both dims)
    x, v = torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.tensor([[0.0, -2.0]], dtype=torch.float64)
    x_s, logp, mean, std, x0 = consistency_step(v, x, 0.5, 0.25, noise=torch.tensor([[1.0, -1.0]]))
    assert x0.tolist() == [[1.0, 1.0]] and mean.tolist() == [[0.75, 0.75]] and x_s.tolist() == [[1.0, 0.5]]
    assert float(std) == 0.25 and float(logp) == pytest.approx(-0.032645, abs=1e-6)
    # scoring the stored x_s gives the same log-prob; greedy (ε = 0) lands on the mean
    assert float(consistency_step(v, x, 0.5, 0.25, prev_sample=x_s)[1]) == float(logp)
    assert torch.equal(consistency_step(v, x, 0.5, 0.25, noise=torch.zeros(1, 2))[0], mean)
    with pytest.raises(ValueError, match="need 0 <= s < t"):
        consistency_step(v, x, 0.25, 0.5, noise=torch.zeros(1, 2))
