"""CM-GRPO (spec 19, ``losses/cm_grpo.py``): the spec's autograd test worked by hand, the
equivalence with REINFORCE on the consistency kernel's log-prob, the objective term on a real flow
rollout, and its refusal of Euler steps."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_nets_close, assert_resume_is_exact, permute_rows, permute_tensor, train_one_and_two_ranks

from groupwise.losses.cm_grpo import CMGRPO, cm_grpo_step_loss
from groupwise.losses.reinforce import Reinforce
from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.gauss import gauss_logp
from groupwise.types import Request, StepInfo

INFO = StepInfo(step=0, seed=3, max_new_tokens=0)


def _spec_case(adv: float):
    # A(s) = 0.8, B(s) = 0.6 (so s = 0.2 would give A = 0.8, B = 0.2: the spec's pair is not the lerp
    # schedule's; the surrogate is written for A, B directly below), x̂₀ = [1,0], x_s = [1.1,−0.3]
    x0 = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    A, B = 0.8, 0.6
    x_s = torch.tensor([1.1, -0.3], dtype=torch.float64)
    mean = A * x0.detach()  # [0.8, 0]
    target = x0.detach() - 0.5 * A * (-adv) * (x_s - mean) / B**2
    return x0, A, B, x_s, target


def test_the_specs_autograd_case_by_hand():
    # ∇_{x̂₀}(Â log π) = Â·A·(x_s − A x̂₀)/B² = 2·0.8·[0.3, −0.3]/0.36 = [1.3333, −1.3333];
    # the surrogate Σ(x̂₀ − target)² has gradient 2(x̂₀ − target) = Â·A(−1)(x_s − mean)/B² = [−1.3333, +1.3333]
    x0, A, B, x_s, target = _spec_case(2.0)
    logp = gauss_logp(x_s[None], A * x0[None], B, reduce="sum")
    (grad_logp,) = torch.autograd.grad(2.0 * logp.sum(), x0)
    assert grad_logp.tolist() == pytest.approx([1.333333, -1.333333], abs=1e-6)
    (grad_sum,) = torch.autograd.grad(((x0 - target) ** 2).sum(), x0)
    assert grad_sum.tolist() == pytest.approx([-1.333333, 1.333333], abs=1e-6)
    # mean over D = 2 dims: half of it
    (grad_mean,) = torch.autograd.grad(((x0 - target) ** 2).mean(), x0)
    assert grad_mean.tolist() == pytest.approx([-0.666667, 0.666667], abs=1e-6)
    # Â = 0: no gradient
    x0, _, _, _, target = _spec_case(0.0)
    assert torch.autograd.grad(((x0 - target) ** 2).mean(), x0)[0].tolist() == [0.0, 0.0]


def test_the_step_loss_on_the_lerp_schedule_by_hand():
    # s = 0.25: A = 0.75, std = 0.25; x̂₀ = [1,1], x_s = [1, 0.5] (mean [0.75,0.75]), Â = 2, scale 1:
    # score_grad = ½·0.75·(−2)·[0.25,−0.25]/0.0625 = −0.75·[4,−4] = [−3, 3]; loss = mean([3², 3²]) = 9;
    # ∂loss/∂x̂₀ = 2·(x̂₀ − target)/D = 2·[−3, 3]/2 = [−3, 3]
    x0 = torch.tensor([[1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    loss = cm_grpo_step_loss(
        x0, torch.tensor([[1.0, 0.5]], dtype=torch.float64), torch.tensor([0.25]), torch.tensor([2.0]), 1.0
    )
    assert float(loss.detach()) == pytest.approx(9.0)
    loss.sum().backward()
    assert x0.grad.tolist() == [[-3.0, 3.0]]


def _batch(policy: FlowPolicy):
    out = policy.generate([Request(key=0, n=4, prompt=1), Request(key=1, n=4, prompt=2)], {}, INFO)
    out.advantages = torch.tensor([[1.5, -0.5, 7.0, -1.0], [0.0, 2.0, -3.0, -6.0]])  # [B,G] (7, -6 get clipped at ±5)
    return out


def _grads(policy, loss):
    policy.net.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in policy.parameters()])


def test_cm_grpo_gradient_equals_reinforce_on_the_kernels_logp_times_scale():
    policy = FlowPolicy(sampler="consistency", steps=4, sde="all")
    batch = _batch(policy)
    term, reinforce = CMGRPO(scale=100.0), Reinforce()
    out = policy.forward(batch, ("logp", "x0_pred"))
    g_cm = _grads(policy, term(batch, out, INFO).sum())
    clipped = batch.advantages.clamp(-5, 5)
    batch.advantages = clipped
    out = policy.forward(batch, ("logp",))
    g_pg = _grads(policy, 100.0 * reinforce(batch, out, INFO).sum())
    # equal up to the float32 rounding of the stored steps and outputs (the maths runs in float64)
    assert g_cm.abs().max() > 0
    assert float((g_cm - g_pg).norm() / g_pg.norm()) < 1e-5


def test_cm_grpo_needs_the_consistency_kernel_and_the_anchor_reads_the_reference():
    euler = FlowPolicy(sde="all")
    batch = _batch(euler)
    with pytest.raises(ValueError, match='not the consistency kernel\'s .*sampler = "consistency"'):
        CMGRPO()(batch, euler.forward(batch, ("logp", "x0_pred")), INFO)
    assert [n.key for n in CMGRPO().needs] == ["x0_pred"]
    assert [n.key for n in CMGRPO(beta=0.1).needs] == ["x0_pred", "ref.step_mean"]
    # with β > 0 and the reference equal to the policy, the anchor adds no gradient (mean = mean_ref)
    policy = FlowPolicy(sampler="consistency", steps=4, sde="all")
    batch = _batch(policy)
    batch.set_extra("ref.step_mean", policy.forward(batch, ("step_mean",))["step_mean"].detach(), "token")
    g0 = _grads(policy, CMGRPO()(batch, policy.forward(batch, ("logp", "x0_pred")), INFO).sum())
    g1 = _grads(policy, CMGRPO(beta=0.5)(batch, policy.forward(batch, ("logp", "x0_pred")), INFO).sum())
    torch.testing.assert_close(g0, g1, rtol=1e-6, atol=1e-9)


def _contract_batch():
    policy = FlowPolicy(sampler="consistency", steps=4, sde="all")
    # a ragged batch: group 1 has 2 real rows and 2 padding rows
    out = policy.generate([Request(key=0, n=4, prompt=1), Request(key=1, n=2, prompt=3)], {}, INFO)
    out.advantages = torch.tensor([[1.0, -2.0, 0.5, 8.0], [-1.0, 1.0, 0.0, 0.0]])  # [B,G]
    return policy, out


def test_contract_shape_finite_and_padding_gets_no_gradient():
    policy, batch = _contract_batch()
    out = policy.forward(batch, ("logp", "x0_pred"))
    loss = CMGRPO()(batch, out, INFO)  # [B,G,T]
    assert loss.shape == batch.mask.shape and loss.dtype == torch.float32 and bool(torch.isfinite(loss).all())
    assert bool((loss[~batch.mask.bool()] == 0).all())
    (grad,) = torch.autograd.grad(loss.sum(), out["x0_pred"])
    assert grad[1, 2:].abs().sum() == 0 and grad[0].abs().sum() > 0  # padding rows: exactly zero


def test_contract_row_permutation_permutes_the_loss():
    policy, batch = _contract_batch()
    loss = CMGRPO()(batch, policy.forward(batch, ("logp", "x0_pred")), INFO)  # [B,G,T]
    perm = torch.tensor([[2, 0, 3, 1], [1, 0, 2, 3]])  # [B,G] (group 1 keeps its padding rows last)
    shuffled = permute_rows(batch, perm)
    again = CMGRPO()(shuffled, policy.forward(shuffled, ("logp", "x0_pred")), INFO)
    torch.testing.assert_close(again, permute_tensor(loss, perm), rtol=0, atol=0)


@pytest.mark.slow  # a torchrun pair (~20 s): make test-slow / test-dist; make test stays under 10 minutes
@pytest.mark.dist
def test_two_ranks_equal_one_process(tmp_path):
    """One CM-GRPO step (SGD, lr 1) over 2 ranks equals one process: the same weights after it."""
    args = [
        "train",
        "cm_grpo",
        'phases=[{name="sft", steps=3, batch_size=16}]',
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "train.steps=1",
        "eval.size=0",
        'update={name="sgd", lr=1.0}',
        "threads=1",
    ]
    one, two = (state["net"] for state in train_one_and_two_ranks(args, tmp_path, "flow_policy.pt", 300))
    start = FlowPolicy(steps=4, sampler="consistency", sde_window=3).state_dict()["net"]
    assert any(not torch.equal(one[k], start[k]) for k in start)  # it trained
    assert_nets_close(one, two)


def test_a_consistency_run_resumes_exactly(tmp_path):
    """Kill-and-resume of a CM-GRPO run (its fit phase, then RL on the consistency kernel) equals the
    uninterrupted run: the same weights and the same logged rewards."""

    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    def trainer(out):
        overrides = [
            f'out="{out}"',
            'phases=[{name="sft", steps=3, batch_size=16}]',
            "train.steps=4",
            "checkpoint.every=2",
            "rollout.prompts_per_step=4",
            "eval.size=4",
        ]
        return Trainer(build(load_config("cm_grpo", overrides)[0]))

    assert_resume_is_exact(trainer, tmp_path)
