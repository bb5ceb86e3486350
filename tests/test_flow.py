"""The 2-D flow-matching policy (modalities/flow.py) and its toy task (modalities/flow_toy.py).

Hand-worked numbers use the SDE step of Flow-/Flash-GRPO: ``std = σ_min + (σ_max − σ_min)·σ``,
``mean = x(1 + std²/(2σ)·dt) + v(1 + std²(1−σ)/(2σ))·dt``, ``x' = mean + std·√(−dt)·ε``.
"""

from __future__ import annotations

import math

import pytest
import torch

from groupwise.modalities.flow import FlowPolicy, VelocityMLP
from groupwise.modalities.flow_sde import flow_sigmas, sde_step_with_logprob
from groupwise.modalities.flow_toy import FlowRegionReward, mixture_centres, mixture_rows, region_reward
from groupwise.seeds import sample_seed
from groupwise.types import Request, StepInfo

INFO = StepInfo(step=3, seed=7, max_new_tokens=0)
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _requests(keys, n=4):
    return [Request(key=k, n=n, prompt=k % 4) for k in keys]


def _labels(ro):
    return torch.tensor([p[0] for p in ro.prompt_ids])


# ---------------------------------------------------------------------------------------------- maths
def test_flow_sigmas_linear_and_shifted():
    torch.testing.assert_close(flow_sigmas(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    # shift 3: 3u/(1+2u) → u=0.75: 2.25/2.5 = 0.9, u=0.5: 1.5/2 = 0.75, u=0.25: 0.75/1.5 = 0.5; the ends stay 1 and 0
    torch.testing.assert_close(flow_sigmas(4, shift=3.0), torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))


def test_sde_step_by_hand():
    # σ=0.9 → σ'=0.8 (dt=−0.1), σ_min=0.6, σ_max=0.9: std = 0.87, std² = 0.7569, std²/(2σ) = 0.4205
    # x-coef = 1 − 0.04205 = 0.95795; v-coef = (1 + 0.7569·0.1/1.8)·(−0.1) = −0.104205
    x, v, eps = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, -1.0]]), torch.tensor([[1.0, -1.0]])
    x_prev, logp, mean, std, sqrt_neg_dt, coe = sde_step_with_logprob(v, x, 0.9, 0.8, 0.6, 0.9, noise=eps)
    torch.testing.assert_close(mean, torch.tensor([[0.95795 - 0.0521025, 0.104205]]))  # [0.9058475, 0.104205]
    torch.testing.assert_close(x_prev, mean + 0.87 * math.sqrt(0.1) * eps)  # noise scale 0.275118
    # logp = mean_d(−ε²/2) − log(0.275118) − log√(2π) = −0.5 + 1.290555 − 0.918939 = −0.128384
    torch.testing.assert_close(logp, torch.tensor([-0.5 - math.log(0.87 * math.sqrt(0.1)) - LOG_SQRT_2PI]))
    torch.testing.assert_close(std, torch.tensor([0.87])) and torch.testing.assert_close(
        sqrt_neg_dt, torch.tensor([math.sqrt(0.1)])
    )
    torch.testing.assert_close(coe, torch.tensor([2.640163]))  # the spec's 1/c at σ = 0.9
    # scoring the stored transition gives the same log-prob
    torch.testing.assert_close(sde_step_with_logprob(v, x, 0.9, 0.8, 0.6, 0.9, prev_sample=x_prev)[1], logp)
    with pytest.raises(ValueError, match="sigma_prev < sigma"):
        sde_step_with_logprob(v, x, 0.8, 0.8, 0.6, 0.9, noise=eps)
    with pytest.raises(ValueError, match="prev_sample"):
        sde_step_with_logprob(v, x, 0.9, 0.8, 0.6, 0.9)


def test_velocity_mlp_shapes_and_conditioning():
    torch.manual_seed(0)
    net = VelocityMLP(4, hidden=16, layers=3)
    x, s = torch.randn(5, 2), torch.rand(5)
    out0, out1 = net(x, s, torch.zeros(5, dtype=torch.long)), net(x, s, torch.ones(5, dtype=torch.long))
    assert out0.shape == (5, 2) and not torch.allclose(out0, out1)  # the label changes the velocity
    assert not torch.allclose(out0, net(x, s * 0.5, torch.zeros(5, dtype=torch.long)))  # so does σ
    assert len(net.hidden) == 1  # layers = 3 linear maps: in → hidden → hidden → out
    with pytest.raises(ValueError, match="layers >= 2"):
        VelocityMLP(4, layers=1)


# ---------------------------------------------------------------------------------------------- the policy
@pytest.mark.parametrize("sde", ["all", "one_shared", "one_per_row"])
def test_forward_recomputes_sampling_logp_and_is_differentiable(sde):
    policy = FlowPolicy(sde=sde, hidden=32)
    reqs = [Request(key=0, n=3, prompt=1), Request(key=1, n=5, prompt=2), Request(key=2, n=5, prompt=0)]  # ragged
    ro = policy.generate(reqs, {"temperature": 1.0}, INFO)
    B, G, T = ro.shape
    assert (B, G, T) == (3, 5, 10 if sde == "all" else 1)
    assert ro.group_valid.tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1] * 5] and torch.equal(
        ro.mask, ro.group_valid[..., None].expand(B, G, T)
    )
    assert ro.extras["flow_x"].shape == (B, G, T, 2) and ro.extras["x_final"].shape == (B, G, 2)
    assert (ro.extras["x_final"][0, 3:] == 0).all() and (ro.logp_sampler[0, 3:] == 0).all()  # padding rows are zeros
    assert ro.completions[0][3:] == ["", ""] and ro.completions[1][0] != ""
    logp = policy.forward(ro, ["logp"])["logp"]  # [B,G,T]
    assert logp.dtype == torch.float32 and logp.requires_grad
    torch.testing.assert_close(logp, ro.logp_sampler, atol=1e-6, rtol=0)
    logp.sum().backward()
    grads = [p.grad for p in policy.parameters()]
    # every layer gets gradient
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    # a micro-batch of groups scores the same as the whole batch
    torch.testing.assert_close(
        policy.forward(ro.select([2, 0]), ["logp"])["logp"].detach(), logp.detach()[[2, 0]], atol=1e-6, rtol=0
    )
    with torch.no_grad():
        assert not policy.forward(ro, ["logp"])["logp"].requires_grad


def test_forward_uses_the_current_weights():
    policy = FlowPolicy(hidden=16)
    ro = policy.generate(_requests(range(4)), {}, INFO)
    old = policy.snapshot()
    with torch.no_grad():
        policy.net.out.bias.add_(0.3)  # move the velocity
    moved = policy.forward(ro, ["logp"])["logp"].detach()
    assert (moved - ro.logp_sampler).abs().max() > 1e-2
    # the snapshot did not move
    torch.testing.assert_close(old.forward(ro, ["logp"])["logp"], ro.logp_sampler, atol=1e-6, rtol=0)


def test_samples_do_not_depend_on_the_rest_of_the_batch():
    policy = FlowPolicy(sde="one_shared", hidden=16)
    alone = policy.generate([Request(key=5, n=4, prompt=1)], {}, INFO)
    crowd = policy.generate(
        [Request(key=9, n=6, prompt=3), Request(key=5, n=4, prompt=1), Request(key=2, n=2, prompt=0)], {}, INFO
    )
    for name in ("x_final", "flow_x", "flow_x_next", "flow_step"):
        assert torch.equal(crowd.extras[name][1, :4], alone.extras[name][0]), name  # float64 maths: bitwise here
    later = policy.generate([Request(key=5, n=4, prompt=1)], {}, StepInfo(step=4, seed=7, max_new_tokens=0))
    # a second request of the prompt this step
    refill = policy.generate([Request(key=5, n=4, offset=4, prompt=1)], {}, INFO)
    assert not torch.allclose(later.extras["x_final"], alone.extras["x_final"])
    assert not torch.allclose(refill.extras["x_final"], alone.extras["x_final"])


def test_ode_steps_are_deterministic_around_the_one_sde_step():
    policy = FlowPolicy(sde="one_shared", hidden=16)
    ro = policy.generate([Request(key=11, n=2, prompt=3)], {}, INFO)
    sig, net, lab = policy.sigmas, policy.net, torch.tensor([3])
    for j in range(2):
        i = int(ro.extras["flow_step"][0, j, 0])
        # the row's x_1 by its seed
        x = torch.randn(2, generator=torch.Generator().manual_seed(sample_seed(7, 3, 11, j)))[None]
        with torch.no_grad():
            for k in range(i):  # Euler steps (float64 maths, float32 state) up to the SDE step reach the stored x_t
                x = (x.double() + net(x, sig[k : k + 1], lab) * float(sig[k + 1] - sig[k])).float()
            torch.testing.assert_close(x[0], ro.extras["flow_x"][0, j, 0])
            x = ro.extras["flow_x_next"][0, j, 0][None]
            for k in range(i + 1, policy.steps):  # and from the SDE step's output to the final sample
                x = (x.double() + net(x, sig[k : k + 1], lab) * float(sig[k + 1] - sig[k])).float()
        torch.testing.assert_close(x[0], ro.extras["x_final"][0, j])
        assert float(ro.extras["flow_sigma"][0, j, 0]) == float(sig[i]) and float(
            ro.extras["flow_sigma_next"][0, j, 0]
        ) == float(sig[i + 1])
    ode = FlowPolicy(sde="none", hidden=16).generate([Request(key=11, n=2, prompt=3)], {}, INFO)
    assert ode.shape == (1, 2, 0) and FlowPolicy(sde="none", hidden=16).forward(ode, ["logp"])["logp"].shape == (
        1,
        2,
        0,
    )


def _chi_square(counts):
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_step_index_shared_per_group_and_uniform_over_the_window():
    shared = FlowPolicy(sde="one_shared", hidden=8).generate(_requests(range(500), n=3), {}, INFO)
    idx = shared.extras["flow_step"][..., 0]  # [500,3]
    assert (idx == idx[:, :1]).all()  # iso-temporal: one index per group
    assert idx.min() >= 0 and idx.max() < 5  # the first half of 10 steps
    assert _chi_square(torch.bincount(idx[:, 0], minlength=5).float()) < 18.47  # χ²(4) 99.9 % quantile
    per_row = (
        FlowPolicy(sde="one_per_row", hidden=8)
        .generate(_requests(range(500), n=3), {}, INFO)
        .extras["flow_step"][..., 0]
    )
    assert (per_row != per_row[:, :1]).any(dim=1).float().mean() > 0.5  # 1 − 1/25 of groups expected to differ
    assert _chi_square(torch.bincount(per_row.flatten(), minlength=5).float()) < 18.47
    window = (
        FlowPolicy(sde="one_shared", sde_window=2, hidden=8)
        .generate(_requests(range(50)), {}, INFO)
        .extras["flow_step"]
    )
    assert set(window.unique().tolist()) == {0, 1}


def test_snapshot_and_state_dict():
    policy = FlowPolicy(hidden=16, init_seed=1)
    snap = policy.snapshot()
    assert snap.trainable is False and snap.parameters() == [] and policy.parameters()
    with torch.no_grad():
        policy.net.out.weight.mul_(2.0)
    assert not torch.equal(snap.net.out.weight, policy.net.out.weight)  # a deep copy
    other = FlowPolicy(hidden=16, init_seed=2)
    assert not torch.equal(other.net.out.weight, policy.net.out.weight)
    other.load_state_dict(policy.state_dict())
    a, b = (p.generate(_requests(range(3)), {}, INFO).extras["x_final"] for p in (policy, other))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="saved from"):
        FlowPolicy(hidden=32).load_state_dict(policy.state_dict())


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="sde must be one of"):
        FlowPolicy(sde="some")
    with pytest.raises(ValueError, match="sde_window"):
        FlowPolicy(steps=4, sde_window=5)
    policy = FlowPolicy(hidden=8)
    with pytest.raises(ValueError, match=r"label in \[0, 4\)"):
        policy.generate([Request(key=0, n=2, prompt=4)], {}, INFO)
    ro = policy.generate([Request(key=0, n=2, prompt=policy.encode(2))], {}, INFO)  # encode gives [label]
    assert ro.prompt_ids == [[2]] and policy.encode([2]) == [2]
    x, y = ro.extras["x_final"][0, 1].tolist()
    assert policy.decode(ro) == ro.completions and ro.completions[0][1] == f"{x:.4f},{y:.4f}"
    with pytest.raises(
        ValueError, match="computes \\['entropy', 'logp', 'step_mean', 'x0_pred'\\], not \\['topk\\(2\\)'\\]"
    ):
        policy.forward(ro, ["topk(2)"])
    # [1,2,1] Gaussian entropy per dim: ½log(2πe) + log(std·√−dt)
    entropy = policy.forward(ro, ["logp", "entropy"])["entropy"]
    step = int(ro.extras["flow_step"][0, 0, 0])
    dt = float(policy.sigmas[step] - policy.sigmas[step + 1])
    std = float(ro.extras["flow_std"][0, 0, 0])
    assert entropy[0, 0, 0].item() == pytest.approx(
        0.5 * math.log(2 * math.pi * math.e) + math.log(std * math.sqrt(dt)), rel=1e-5
    )
    del ro.extras["flow_x"]
    with pytest.raises(ValueError, match="flow_x"):
        policy.forward(ro, ["logp"])


# ---------------------------------------------------------------------------------------------- the toy task
def test_region_reward_by_hand():
    # 4 labels: centres (2,0), (0,2), (−2,0), (0,−2); radius 0.75
    torch.testing.assert_close(
        mixture_centres(4), torch.tensor([[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, -2.0]]), atol=1e-6, rtol=0
    )
    x = torch.tensor([[[2.5, 0.0], [2.8, 0.0], [0.0, 2.0]], [[0.0, 1.3], [2.0, 0.0], [0.4, 2.5]]])  # [2,3,2]
    # label 0: d = 0.5 in, 0.8 out, (0,2) is 2.83 away; label 1: d = 0.7 in, 2.83 out, √(0.16+0.25) = 0.64 in
    assert region_reward(x, torch.tensor([0, 1])).tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]]
    assert region_reward(x, torch.tensor([0, 1]), radius=0.85).tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="labels"):
        region_reward(x, torch.tensor([0, 4]))
    # the prior N(0, I) lands in one region 4.3 % of the time (the docstring's number)
    z = torch.randn(1, 400_000, 2, generator=torch.Generator().manual_seed(0))
    assert abs(region_reward(z, torch.tensor([0])).mean().item() - 0.043) < 0.002


def test_flow_region_scorer_reads_x_final():
    policy = FlowPolicy(hidden=8)
    ro = policy.generate([Request(key=0, n=2, prompt=1), Request(key=1, n=3, prompt=2)], {}, INFO)
    ro.extras["x_final"] = torch.tensor([[[0.0, 2.0], [0.0, 0.0], [0.0, 2.0]], [[-2.0, 0.5], [5.0, 5.0], [-2.0, 0.0]]])
    scorer = FlowRegionReward()
    assert scorer.weight == 1.0 and not callable(scorer)  # a rollout scorer
    # row (0, 2) is padding (request 0 has n = 2): 0 although it sits on its centre
    assert scorer.score_rollout(ro, INFO).tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]]
    del ro.extras["x_final"]
    with pytest.raises(ValueError, match="x_final"):
        scorer.score_rollout(ro, INFO)


def test_mixture_rows():
    rows = mixture_rows(200, n_labels=4, seed=3)
    assert rows == mixture_rows(200, n_labels=4, seed=3) and rows != mixture_rows(200, n_labels=4, seed=4)
    assert {r["prompt"] for r in rows} == {0, 1, 2, 3} and all(isinstance(r["prompt"], int) for r in rows)
