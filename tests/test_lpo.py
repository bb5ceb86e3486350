"""LPO (specs/57), worked by hand.

Spec: A = [1, 0, −1], tau = 1, theta = theta_old (lam = 0, p uniform 1/3)::

    p_star = softmax(A) = e^A / (e + 1 + 1/e) = [.665241, .244728, .090031]
    fkl    = Σ p_star·log(3·p_star) = .266217;   ∂/∂lam = 1/3 − p_star = [−.331908, .088605, .243303]
    rkl    = (1/3)·Σ log(1/(3·p_star)) = .308994; ∂/∂lam = (1/3)·((log p − log p_star) − rkl) = [−1/3, 0, 1/3]

Off-policy, rows of 2, 1 and 3 tokens with d = [.1, .1], [−.1], [.3, −.3, 0] → lam = Σ_t d = [.2, −.1, 0]:

    p = softmax(lam) = [1.221403, .904837, 1]/3.126240 = [.390694, .289433, .319873]
    fkl = Σ p_star·(log p_star − log p) = .198860;  ∂/∂lam = p − p_star = [−.274547, .044705, .229842]
    rkl = Σ p·(log p − log p_star) = .246150;  ∂/∂lam = p·((log p − log p_star) − rkl) = [−.304106, −.022684, .326790]
    every token of row i gets ∂/∂lam_i (lam is a sum over its tokens)
    length_norm: lam = [.1, −.1, 0] → p = [.367165, .300610, .332225], fkl = .227496,
                 ∂/∂lam = [−.298076, .055881, .242194], each token gets ∂/∂lam_i / |y_i|
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_micro_batch_invariant,
    info_for,
    make_logp,
    make_rollout,
    objective_for,
    rollout_from,
    train_recorded,
)

from groupwise.losses.lpo import lpo_loss, lpo_target
from groupwise.registry import build

A = [1.0, 0.0, -1.0]
P_STAR = [0.665241, 0.244728, 0.090031]
MASK3 = [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
D3 = [[0.1, 0.1, 0.0], [-0.1, 0.0, 0.0], [0.3, -0.3, 0.0]]


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def _run(d, adv, mask=None, agg="group_mean", rewards=None, **params):
    """Loss and d(loss)/d(logp) through the Objective for groups of rows with token log-ratios d."""
    d = torch.as_tensor(d, dtype=torch.float32)
    d = d if d.dim() == 3 else d[None]  # [B,G,T]
    mask = None if mask is None else torch.as_tensor(mask, dtype=torch.bool).reshape(d.shape)
    adv = torch.as_tensor(adv, dtype=torch.float32).reshape(d.shape[:2])
    ro = rollout_from(torch.full(d.shape, -1.0), adv, mask=mask, rewards=rewards)
    logp = (ro.logp_old + d).requires_grad_(True)
    obj = objective_for([build("objective", "lpo", **params)], agg)
    info = info_for(d.shape[-1])
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, ro, logp


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_target_and_losses_at_theta_old():
    _close(lpo_target(torch.tensor([A])), [P_STAR])
    loss, grad, _, _ = _run([[0.0], [0.0], [0.0]], A)  # one token per row: ∂/∂logp = ∂/∂lam
    _close(loss, 0.266217)
    _close(grad[0, :, 0], [-0.331908, 0.088605, 0.243303])
    assert abs(float(grad.sum())) < 1e-7
    loss, grad, _, _ = _run([[0.0], [0.0], [0.0]], A, divergence="rkl")
    _close(loss, 0.308994)
    _close(grad[0, :, 0], [-1 / 3, 0.0, 1 / 3])


def test_spec_function_interface():
    lam = torch.zeros(1, 3, requires_grad=True)
    loss, m = lpo_loss(lam, torch.zeros(1, 3), torch.tensor([A]))
    _close(loss, 0.266217)
    _close(m["p"], [[1 / 3] * 3])
    _close(m["p_star"], [P_STAR])
    with pytest.raises(ValueError, match="divergence"):
        lpo_loss(lam, torch.zeros(1, 3), torch.tensor([A]), divergence="js")


def test_equal_advantages_give_exact_zero():
    for divergence in ("fkl", "rkl"):
        loss, grad, _, _ = _run([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], [0.7, 0.7, 0.7], divergence=divergence)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


# ---------------------------------------------------------------------------------------------- gradients
def test_off_policy_gradients_match_the_hand_derived_ones():
    loss, grad, _, _ = _run(D3, A, mask=MASK3)
    _close(loss, 0.198860)
    want = torch.tensor([-0.274547, 0.044705, 0.229842])[:, None] * torch.tensor(MASK3, dtype=torch.float32)  # [3,3]
    _close(grad[0], want)
    loss, grad, _, _ = _run(D3, A, mask=MASK3, divergence="rkl")
    _close(loss, 0.246150)
    _close(grad[0], torch.tensor([-0.304106, -0.022684, 0.326790])[:, None] * torch.tensor(MASK3, dtype=torch.float32))


@pytest.mark.parametrize("divergence", ["fkl", "rkl"])
def test_closed_form_gradient_equals_autograd_of_the_plain_kl(divergence):
    g = torch.Generator().manual_seed(2)
    lam = (torch.randn(4, 5, generator=g) * 2).requires_grad_(True)
    adv = torch.randn(4, 5, generator=g)
    valid = torch.rand(4, 5, generator=g) < 0.8
    loss, _ = lpo_loss(lam, torch.zeros(4, 5), adv, 0.7, divergence, valid)
    (got,) = torch.autograd.grad(loss, lam)
    lam2 = lam.detach().clone().requires_grad_(True)
    x = torch.where(valid, lam2, torch.full((), -torch.inf))
    log_p = torch.log_softmax(x, 1)
    log_star = torch.log_softmax(torch.where(valid, adv / 0.7, torch.full((), -torch.inf)), 1)
    log_p, log_star = torch.where(valid, log_p, 0.0), torch.where(valid, log_star, 0.0)  # finite outside valid
    p, ps = log_p.exp(), log_star.exp()
    # [4]
    kl = torch.where(valid, ps * (log_star - log_p) if divergence == "fkl" else p * (log_p - log_star), 0.0).sum(1)
    has = valid.any(1)
    plain = kl[has].mean()
    (want,) = torch.autograd.grad(plain, lam2)
    torch.testing.assert_close(loss, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, torch.where(valid, want, 0.0), atol=1e-6, rtol=1e-6)


def test_length_norm_by_hand():
    loss, grad, _, _ = _run(D3, A, mask=MASK3, length_norm=True)
    _close(loss, 0.227496)
    per_row = torch.tensor([-0.298076 / 2, 0.055881 / 1, 0.242194 / 3])[:, None]
    _close(grad[0], per_row * torch.tensor(MASK3, dtype=torch.float32))


def test_gradients_are_bounded_zero_sum_and_first_order_grpo():
    g = torch.Generator().manual_seed(0)
    d = torch.randn(5, 6, 1, generator=g) * 4.0  # far from theta_old
    adv = torch.randn(5, 6, generator=g) * 3.0
    for divergence in ("fkl", "rkl"):
        _, grad, _, _ = _run(d, adv, divergence=divergence)  # group_mean over 5 groups: grad = ∂L_g/∂lam / 5
        grad = grad[..., 0] * 5
        torch.testing.assert_close(grad.sum(1), torch.zeros(5), atol=1e-6, rtol=0)  # zero-sum (both)
        if divergence == "fkl":
            assert (grad.abs() <= 1.0).all()  # p − p_star: bounded (the reverse one is not)
    # small A / tau at theta_old: 1/n − p_star ≈ −(A − mean A)/(n·tau) = ∓.0025, ∓.00125 here; the
    # second-order rest is (.01²/(2n))·|(a − ā)² − mean (a − ā)²| <= 1e-5
    small = torch.tensor([[1.0, 0.5, -0.5, -1.0]])
    _, grad, _, _ = _run(torch.zeros(1, 4, 1), small * 0.01)
    _close(grad[0, :, 0], -(small[0] - small.mean()) * 0.01 / 4, atol=1e-5)


def test_forward_loss_decreases_monotonically_over_20_adam_steps():
    g = torch.Generator().manual_seed(1)
    ro = make_rollout(4, 6, 5, seed=3, awkward=False)
    ro.advantages = torch.randn(4, 6, generator=g)
    free = (ro.logp_old + 0.1 * torch.randn(ro.logp_old.shape, generator=g)).requires_grad_(True)  # a free "policy"
    opt = torch.optim.Adam([free], lr=0.02)
    obj = objective_for([build("objective", "lpo")], "group_mean")
    losses = []
    for _ in range(20):
        loss = obj.loss(ro, {"logp": free}, obj.normalizers(ro, info_for(5)), info_for(5), record=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0]


# ---------------------------------------------------------------------------------------------- edge cases
def test_masked_tokens_empty_rows_and_nan_rewards_are_outside_the_simplex():
    # the spec group plus: a row with no loss token, a row with a NaN reward, garbage beyond the mask
    d = [[0.0, 50.0], [0.0, -70.0], [0.0, 9.0], [33.0, 33.0], [0.0, 0.0]]
    mask = [[1, 0], [1, 0], [1, 0], [0, 0], [1, 1]]
    rewards = torch.tensor([[1.0, 0.5, 0.0, 1.0, float("nan")]])
    loss, grad, _, _ = _run(d, A + [5.0, 9.0], mask=mask, rewards=rewards)
    _close(loss, 0.266217)
    _close(grad[0, :3, 0], [-0.331908, 0.088605, 0.243303])
    assert torch.equal(grad[0, 3:], torch.zeros(2, 2)) and torch.equal(grad[0, :3, 1], torch.zeros(3))


def test_single_member_and_empty_groups_are_zero_and_finite():
    d = torch.zeros(3, 2, 1)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.bool)[..., None]  # group 1: one row, group 2: none
    loss, grad, ro, logp = _run(d, [[1.0, -1.0], [2.0, 0.0], [0.0, 0.0]], mask=mask)
    # p_star = softmax([1, −1]) = [.880797, .119203]; fkl = .880797·log(1.761594) + .119203·log(.238406)
    #        = .880797·.566219 − .119203·1.433781 = .498724 − .170911 = .327813, over 2 groups
    _close(loss, 0.327813 / 2)
    values = build("objective", "lpo")(ro, {"logp": logp}, info_for(1))
    assert values[1].tolist() == [0.0, 0.0] and values[2].tolist() == [0.0, 0.0]
    assert torch.isfinite(grad).all() and torch.equal(grad[1:], torch.zeros(2, 2, 1))


def test_micro_batching_invariance():
    B, G, T = 6, 4, 5
    ro = make_rollout(B, G, T, seed=5)
    logp = make_logp(ro, scale=0.5)
    for agg in ("group_mean", "seq_mean_token_mean", "token_mean"):
        for params in ({}, {"divergence": "rkl", "length_norm": True, "tau": 0.5}):
            assert_micro_batch_invariant(build("objective", "lpo", agg=agg, **params), agg, ro, logp)


def test_group_mean_aggregation_by_hand():
    # group 0: rows with token means 1 and 3 → 2; group 1: one counted row of mean 4 (the other has no token) → 4
    agg = build("aggregation", "group_mean")
    values = torch.tensor([[[1.0, 1.0], [2.0, 4.0]], [[4.0, 9.0], [7.0, 7.0]]])
    mask = torch.tensor([[[1, 1], [1, 1]], [[1, 0], [0, 0]]], dtype=torch.bool)
    norm = agg.normalizer(mask, info_for(2))
    assert norm["groups"].item() == 2
    assert agg.reduce(values, mask, norm).item() == pytest.approx(3.0)
    # row values
    assert agg.reduce(torch.tensor([[5.0, 5.0], [8.0, 1.0]]), mask, norm).item() == pytest.approx((5.0 + 8.0) / 2)


def test_stats_and_validation():
    _, _, ro, logp = _run([[0.0], [0.0], [0.0]], A)
    s = build("objective", "lpo").stats(ro, {"logp": logp})
    # tv = ½·Σ|1/3 − p_star| = ½·(.331908 + .088605 + .243303) = .331908
    _close(s["tv"], [[0.331908] * 3])
    _close(s["divergence"], [[0.266217] * 3])
    for params, match in (({"tau": 0.0}, "tau"), ({"divergence": "kl"}, "divergence")):
        with pytest.raises(ValueError, match=match):
            build("objective", "lpo", **params)


# ---------------------------------------------------------------------------------------------- training
def test_two_steps_on_the_embedded_model(tmp_path):
    rows, seen = train_recorded(tmp_path, "lpo", "rollout.group_size=8")
    for row, batch in zip(rows, seen):
        # one epoch, one mini-batch: on-policy, p uniform over each group's members → tv from the advantages alone
        members = batch.row_mask.any(-1) & torch.isfinite(batch.rewards)  # [B,G]
        p_star = lpo_target(batch.advantages, 1.0, members)  # [B,G]
        n = members.sum(1, keepdim=True).clamp(min=1)
        tv = 0.5 * torch.where(members, (1.0 / n - p_star).abs(), 0.0).sum(1)  # [B]
        rows_per_group = batch.row_mask.any(-1).sum(1)  # the statistic averages over rows with loss tokens
        want = float((tv * rows_per_group).sum() / rows_per_group.sum())
        assert row["tv"] == pytest.approx(want, abs=1e-5) and want > 0
