"""Flash-GRPO (spec 14): temporal gradient rectification, iso-temporal indices, the loss, and a
learning check on Toy-Flow-2D. Unit numbers are the spec's; the rest are worked in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from groupwise.advantages.grpo import GRPOAdvantage
from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.flow_sde import flow_sigmas, noise_std
from groupwise.modalities.flow_toy import region_reward
from groupwise.types import Request, Rollout, StepInfo
from groupwise.weights.flash_rectification import (
    FlashRectification,
    flash_grpo_loss,
    iso_temporal_indices,
    rectification_coefficient,
    sde_step_with_logprob,
)

TOY = [1.0, 0.9, 0.8, 0.7, 0.6]  # the spec's schedule: σ_max = sigmas[1] = 0.9, σ_min = sigmas[-1] = 0.6
INFO = StepInfo(step=0, seed=0, max_new_tokens=0)


def test_spec_toy_schedule_coefficients():
    s, sp = torch.tensor(TOY[:3], dtype=torch.float64), torch.tensor(TOY[1:4], dtype=torch.float64)
    std = noise_std(s, 0.6, 0.9)
    torch.testing.assert_close(std, torch.tensor([0.9, 0.87, 0.84], dtype=torch.float64))
    c = rectification_coefficient(s, sp, std)
    # step 0: √0.1/0.9 = 0.351364 (σ = 1: no second term); step 1: 0.363480 + 0.87·√0.1·0.1/1.8 = 0.378765
    torch.testing.assert_close(c, torch.tensor([0.351364, 0.378765, 0.409666], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        1 / c, torch.tensor([2.846050, 2.640163, 2.441016], dtype=torch.float64), atol=1e-6, rtol=0
    )
    # the SDE step reports the same coe
    coe = sde_step_with_logprob(torch.zeros(3, 2), torch.zeros(3, 2), s, sp, 0.6, 0.9, noise=torch.zeros(3, 2))[5]
    torch.testing.assert_close(coe, torch.tensor([2.846050, 2.640163, 2.441016]), atol=1e-6, rtol=0)


def _rollout(sigma, sigma_next, std, valid=None, mask=None) -> Rollout:
    """B=1 group, G rows, T=1 trained step, with the flow policy's extras."""
    G = len(sigma)
    ro = Rollout(
        prompt_ids=[[0]],
        actions=torch.zeros(1, G, 1, dtype=torch.long),
        mask=torch.ones(1, G, 1, dtype=torch.bool) if mask is None else torch.tensor(mask).view(1, G, 1),
        group_valid=torch.ones(1, G, dtype=torch.bool) if valid is None else torch.tensor(valid).view(1, G),
        truncated=torch.zeros(1, G, dtype=torch.bool),
        prompt_index=torch.zeros(1, dtype=torch.long),
    )
    for name, v in (("flow_sigma", sigma), ("flow_sigma_next", sigma_next), ("flow_std", std)):
        ro.set_extra(name, torch.tensor(v, dtype=torch.float32).view(1, G, 1), "token")
    return ro


def test_spec_batch_weights_for_indices_0_and_2():
    ro = _rollout([1.0, 0.8], [0.9, 0.7], [0.9, 0.84])
    w = FlashRectification()(ro, INFO)
    # [2.846050, 2.441016] / 2.643533
    torch.testing.assert_close(w.flatten(), torch.tensor([1.076609, 0.923391]), atol=1e-6, rtol=0)
    assert w.dtype == torch.float32 and w.shape == (1, 2, 1)
    # an invalid row and a masked step (garbage σ = 0 there) get 0 and leave the mean alone
    ro = _rollout(
        [1.0, 0.8, 0.0, 0.0], [0.9, 0.7, 0.0, 0.0], [0.9, 0.84, 0.0, 0.0], valid=[1, 1, 0, 1], mask=[1, 1, 1, 0]
    )
    torch.testing.assert_close(
        FlashRectification()(ro, INFO).flatten(), torch.tensor([1.076609, 0.923391, 0.0, 0.0]), atol=1e-6, rtol=0
    )


def test_weight_needs_flow_extras():
    ro = _rollout([1.0], [0.9], [0.9])
    del ro.extras["flow_std"]
    with pytest.raises(ValueError, match=r"flow_std.*flow policy"):
        FlashRectification()(ro, INFO)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        FlashRectification()(_rollout([0.5], [0.6], [0.9]), INFO)


def test_weight_on_a_flow_policy_rollout():
    policy = FlowPolicy(sde="all", hidden=8)
    ro = policy.generate([Request(key=k, n=2, prompt=k % 4) for k in range(3)], {}, INFO)
    w = FlashRectification()(ro, INFO)  # [3,2,10]
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))  # every row valid: mean 1 over the trained steps
    assert torch.equal(w[0, 0], w[2, 1])  # a function of the step only
    assert (w[0, 0].diff() < 0).all()  # on the linear schedule, 1/c shrinks as σ falls: high-noise steps weigh more


def test_wan_reference_table():
    # Wan 20 steps, shift 3: the authors' hard-coded 1/c at timesteps 999 … 785 (the first 10 steps)
    table = torch.tensor(
        [7.4770, 7.0414, 6.6112, 6.1867, 5.7682, 5.3559, 4.9502, 4.5513, 4.1596, 3.7754], dtype=torch.float64
    )
    s = flow_sigmas(20, shift=3.0).double()
    std = noise_std(s[:10], float(s[-1]), float(s[1]))
    coe = 1 / rectification_coefficient(s[:10], s[1:11], std)
    # measured: 0.10 % at most (our timesteps are not floored to ints)
    assert ((coe / table - 1).abs() < 1.5e-3).all(), coe


def test_autograd_identity_coe_times_grad_is_timestep_independent():
    eps = torch.tensor([[0.7, -1.3]], dtype=torch.float64)  # the same ε at every step
    x = torch.tensor([[0.4, 0.2]], dtype=torch.float64)
    steps = [(1.0, 0.9, 0.6, 0.9), (0.7, 0.6, 0.6, 0.9), (0.5, 0.45, 0.0, 0.95)]  # (σ, σ', σ_min, σ_max)
    scaled, raw = [], []
    for s, sp, lo, hi in steps:
        v = torch.tensor([[0.3, -0.5]], dtype=torch.float64, requires_grad=True)
        _, logp, _, std, _, coe = sde_step_with_logprob(v, x, s, sp, lo, hi, noise=eps)
        (grad,) = torch.autograd.grad(logp.sum(), v)
        c = rectification_coefficient(torch.tensor(s), torch.tensor(sp), std.detach())
        torch.testing.assert_close(grad, -c * eps / 2, atol=1e-6, rtol=0)  # ∂logp/∂v = −c(t)·ε/D, D = 2
        scaled.append(coe * grad)
        raw.append(grad)
    for g in scaled[1:]:
        torch.testing.assert_close(g, scaled[0], atol=1e-6, rtol=0)  # = −ε/D
    torch.testing.assert_close(scaled[0], -eps / 2, atol=1e-6, rtol=0)
    assert (raw[1] / raw[0] - 1).abs().min() > 0.05  # without coe the scales differ (so the check can fail)


def _chi_square(counts):
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_iso_temporal_indices():
    ids = torch.tensor([7, 3, 7, 7, 3, 9, 9, 3])
    idx = iso_temporal_indices(ids, 10, torch.Generator().manual_seed(0))
    assert idx.dtype == torch.int64 and ((idx >= 0) & (idx < 10)).all()
    for p in (3, 7, 9):
        assert len(set(idx[ids == p].tolist())) == 1  # one index per prompt group
    again = iso_temporal_indices(ids, 10, torch.Generator().manual_seed(0))
    assert torch.equal(idx, again)
    many = iso_temporal_indices(torch.arange(20_000).repeat_interleave(2), 10, torch.Generator().manual_seed(1))
    assert torch.equal(many[0::2], many[1::2])
    assert _chi_square(torch.bincount(many[0::2], minlength=10).float()) < 27.88  # χ²(9) 99.9 % quantile
    with pytest.raises(ValueError, match="num_candidates"):
        iso_temporal_indices(ids, 0)


def test_flash_grpo_loss_by_hand():
    logp = torch.tensor([0.0, math.log(1.01)], requires_grad=True)
    old, adv, coe = torch.zeros(2), torch.tensor([1.0, 1.0]), torch.tensor([2.0, 1.0])
    loss = flash_grpo_loss(logp, old, adv, coe)
    # w = [4/3, 2/3]; row 0: ρ = 1 → −4/3; row 1: ρ = 1.01 > 1.001, A > 0 → max(−2/3·1.01, −2/3·1.001) = −0.667333
    torch.testing.assert_close(loss, torch.tensor((-4 / 3 - 2 / 3 * 1.001) / 2))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([-4 / 3 / 2, 0.0]))  # the clipped row gets no gradient


# ---------------------------------------------------------------------------------------------- learning check
def _eval_reward(policy: FlowPolicy) -> float:
    """Mean region reward of ODE samples (sde="none") on a fixed seed set: 32 prompts × 16 rows."""
    ode = FlowPolicy(sde="none", hidden=policy.config["hidden"])
    ode.load_state_dict(policy.state_dict())
    ro = ode.generate(
        [Request(key=1000 + k, n=16, prompt=k % 4) for k in range(32)],
        {},
        StepInfo(step=0, seed=1234, max_new_tokens=0),
    )
    return region_reward(ro.extras["x_final"], torch.tensor([p[0] for p in ro.prompt_ids])).mean().item()


def test_flash_grpo_raises_the_toy_reward():
    policy = FlowPolicy(sde="one_shared", init_seed=0)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    before = _eval_reward(policy)
    for step in range(40):
        info = StepInfo(step=step, seed=0, max_new_tokens=0)
        keys = [(step * 16 + k) % 64 for k in range(16)]
        ro = policy.generate([Request(key=k, n=16, prompt=k % 4) for k in keys], {}, info)
        ro.rewards = region_reward(ro.extras["x_final"], torch.tensor([p[0] for p in ro.prompt_ids]))  # [16,16]
        adv = GRPOAdvantage()(ro, info)  # [16,16]
        w = FlashRectification()(ro, info)  # [16,16,1]
        logp = policy.forward(ro, ["logp"])["logp"]  # [16,16,1]
        loss = -(adv[..., None] * w * logp)[ro.mask].mean()  # on-policy: the PPO-clip gradient is this REINFORCE one
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _eval_reward(policy)
    # measured: 0.055 → 0.598 in 0.5 s; init seeds 0-4 all gain 0.54 to 0.92 (lr 2e-2 instead collapses to 0)
    print(f"flash-grpo toy: eval reward {before:.3f} -> {after:.3f}")
    assert before < 0.1 and after > before + 0.4, (before, after)
