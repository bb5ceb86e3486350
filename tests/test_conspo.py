"""ConSPO (specs/25), worked by hand. l_p = softplus(logsumexp_n(s_n/tau) − (s_p − m)/tau)::

one pair, tau = 1, m = 0, s_p = −1, s_n = −.5:  l = log(1 + e^{.5}) = .974077
    q_p = 1/(1 + e^{.5}) = .377541 → ∂l/∂s_p = −(1 − q_p) = −.622459, ∂l/∂s_n = q_n = +.622459
group s = [−.8, −1.2, −.5, −1.5], rewards [1, 1, 0, 0]:
    tau = 1,  m = 0:  lse_n = log(e^−.5 + e^−1.5) = −.186738
                      l = [softplus(.613262), softplus(1.013262)] = [1.046071, 1.322974] → mean 1.184522
    tau = .5, m = .2: lse_n = log(e^−1 + e^−3) = −.873072; (s_p − m)/tau = [−2, −2.8]
                      l = [softplus(1.126928), softplus(1.926928)] = [1.407606, 2.062852] → mean 1.735229
(the spec gives these to 4–5 places: [1.0461, 1.3230] 1.18452, [1.4076, 2.0629] 1.73523)
GRPO on rewards [1, 0, 0, 0], population std: p = 1/4, sigma = sqrt(p(1 − p)) = .433013,
    A+ = (1 − p)/sigma = 1.732051, A− = −p/sigma = −.577350
"""

from __future__ import annotations

import math

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

from groupwise.losses.conspo import SCALE_KEY, conspo_group_loss, conspo_loss, seq_scores
from groupwise.registry import build

S = [-0.8, -1.2, -0.5, -1.5]
R = [1.0, 1.0, 0.0, 0.0]


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def _run(s, rewards, mask=None, agg="group_mean", prepare=True, **params):
    """Loss and ∂loss/∂logp through the Objective; one token per row unless ``s`` is [B,G,T] (then s = token logps)."""
    s = torch.as_tensor(s, dtype=torch.float32)
    logp0 = s.reshape(-1, s.shape[-1], 1) if s.dim() < 3 else s  # [B,G,T]
    rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(logp0.shape[:2])
    mask = None if mask is None else torch.as_tensor(mask, dtype=torch.bool).reshape(logp0.shape)
    ro = rollout_from(torch.zeros_like(logp0), torch.zeros(logp0.shape[:2]), mask=mask, rewards=rewards)
    term = build("objective", "conspo", **params)
    info = info_for(logp0.shape[-1])
    if prepare:
        term.prepare(ro, info)
    logp = logp0.clone().requires_grad_(True)
    obj = objective_for([term], agg)
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, ro, term


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_single_pair():
    loss, grad, _, _ = _run([-1.0, -0.5], [1.0, 0.0], tau=1.0)
    _close(loss, 0.974077)
    _close(grad.flatten(), [-0.622459, 0.622459])


def test_spec_group():
    s = torch.tensor([S])
    pos, neg = torch.tensor([[True, True, False, False]]), torch.tensor([[False, False, True, True]])
    group, l = conspo_group_loss(s, pos, neg, 1.0, 0.0)
    _close(l, [[1.046071, 1.322974, 0.0, 0.0]])
    _close(group, [1.184522])
    group, l = conspo_group_loss(s, pos, neg, 0.5, 0.2)
    _close(l, [[1.407606, 2.062852, 0.0, 0.0]])
    _close(group, [1.735229])
    loss, _, _, _ = _run(S, R, tau=0.5, margin=0.2)  # the term through the Objective: the same number
    _close(loss, 1.735229)
    loss, scores = conspo_loss(
        torch.tensor([S])[..., None], torch.ones(1, 4, 1, dtype=torch.bool), torch.tensor([R]), 1.0, 0.0
    )
    _close(loss, 1.184522)
    _close(scores, [S])


def test_spec_grpo_identity_of_the_discriminative_view():
    ro = rollout_from(torch.zeros(3, 4, 1), rewards=torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]))
    adv = build("advantage", "grpo", std="population", eps=0.0)(ro, info_for(1))
    _close(adv[0], [1.732051, -0.577350, -0.577350, -0.577350])
    for row, p in zip(adv, (0.25, 0.5, 0.75)):  # A+ = (1 − p)/sigma, A− = −p/sigma, sigma = sqrt(p(1 − p))
        sigma = math.sqrt(p * (1 - p))
        n_pos = int(p * 4)
        _close(row, [(1 - p) / sigma] * n_pos + [-p / sigma] * (4 - n_pos), atol=1e-5)


def test_spec_length_normalisation():
    logp = torch.tensor([[[-1.0, -1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]]])
    mask = torch.tensor([[[1, 1, 0, 0], [1, 1, 1, 1]]], dtype=torch.bool)
    _close(seq_scores(logp, mask), [[-1.0, -1.0]])


# ---------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("tau, margin", [(1.0, 0.0), (0.5, 0.2), (0.1, 0.05)])
def test_gradient_matches_the_softmax_form(tau, margin):
    # ∂L/∂s_p = −(1 − q_p^(p))/tau / |P|, ∂L/∂s_n = Σ_p q_n^(p)/tau / |P|, q^(p) = softmax([(s_p − m)/tau, s_n/tau ...])
    _, grad, _, _ = _run(S, R, tau=tau, margin=margin)
    want = [0.0] * 4
    for p in (0, 1):
        q = torch.softmax(torch.tensor([(S[p] - margin) / tau, S[2] / tau, S[3] / tau]), 0)
        want[p] += -(1 - float(q[0])) / tau / 2
        want[2] += float(q[1]) / tau / 2
        want[3] += float(q[2]) / tau / 2
    _close(grad.flatten(), want, atol=2e-6)
    if (tau, margin) == (0.5, 0.2):
        _close(grad.flatten(), [-0.755272, -0.872909, 1.434097, 0.194084])


def test_token_gradient_is_the_score_gradient_over_the_length():
    # rows of 2 and 4 tokens, all logp −1 / −.5 → s = −1, −.5 as the single pair: each token gets ∂l/∂s / |y|
    logp = torch.tensor([[[-1.0, -1.0, 7.0, 7.0], [-0.5, -0.5, -0.5, -0.5]]])
    mask = torch.tensor([[[1, 1, 0, 0], [1, 1, 1, 1]]], dtype=torch.bool)
    loss, grad, _, _ = _run(logp, [1.0, 0.0], mask=mask, tau=1.0)
    _close(loss, 0.974077)
    _close(grad, [[[-0.622459 / 2] * 2 + [0.0, 0.0], [0.622459 / 4] * 4]])


# ---------------------------------------------------------------------------------------------- edge cases
def test_constant_single_and_empty_groups_are_exactly_zero():
    s = [[-0.8, -1.2, -0.5], [-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]]
    rewards = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, float("nan"), float("nan")], [0.0, 1.0, 0.0]]
    mask = torch.ones(4, 3, 1, dtype=torch.bool)
    mask[3] = False  # group 3 has no loss token at all
    for norm in ("mixed", "all"):
        loss, grad, ro, term = _run(s, rewards, mask=mask, norm=norm)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
        values = term(ro, {"logp": torch.tensor(s)[..., None]}, info_for(1))
        assert torch.equal(values, torch.zeros(4, 3))


def test_nan_rewards_masked_tokens_and_empty_rows_are_in_neither_set():
    # the spec group plus: a row with a NaN reward, a row without loss tokens, garbage beyond the mask
    logp = torch.tensor([[[-0.8, 50.0], [-1.2, -60.0], [-0.5, 9.0], [-1.5, 0.0], [5.0, 5.0], [9.0, 9.0]]])
    mask = torch.tensor([[[1, 0], [1, 0], [1, 0], [1, 0], [1, 1], [0, 0]]], dtype=torch.bool)
    rewards = [1.0, 1.0, 0.0, 0.0, float("nan"), 0.0]
    loss, grad, _, _ = _run(logp, rewards, mask=mask, tau=0.5, margin=0.2)
    _close(loss, 1.735229)
    _close(grad[0, :4, 0], [-0.755272, -0.872909, 1.434097, 0.194084])
    assert torch.equal(grad[0, 4:], torch.zeros(2, 2)) and torch.equal(grad[0, :4, 1], torch.zeros(4))


def test_norm_mixed_averages_over_groups_with_both_and_all_over_every_group():
    s = [S, [-1.0, -2.0, -3.0, -4.0], [-1.0, -2.0, -3.0, -4.0]]
    rewards = [R, [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]  # one mixed group of three
    loss, _, ro, term = _run(s, rewards, tau=1.0)
    _close(loss, 1.184522)
    assert ro.extras[SCALE_KEY].tolist() == [3.0, 3.0, 3.0] and ro.extra_levels[SCALE_KEY] == "group"
    loss, _, ro, _ = _run(s, rewards, tau=1.0, norm="all")
    _close(loss, 1.184522 / 3)
    assert ro.extras[SCALE_KEY].tolist() == [1.0, 1.0, 1.0]
    # without prepare (a bare call) the rows given are the batch: the same here
    loss, _, _, _ = _run(s, rewards, tau=1.0, prepare=False)
    _close(loss, 1.184522)


def test_micro_batching_invariance_with_the_step_scale():
    B, G, T = 6, 4, 5
    ro = make_rollout(B, G, T, seed=5, binary=True)
    logp = make_logp(ro, scale=0.5)
    for agg in ("group_mean", "seq_mean_token_mean"):
        for params in ({}, {"norm": "all", "tau": 0.5, "margin": 0.1}):
            assert_micro_batch_invariant(build("objective", "conspo", agg=agg, **params), agg, ro, logp)
    # the guard: each micro-batch's own count of groups with both would give another loss
    term = build("objective", "conspo")
    term.prepare(ro, info_for(T))
    whole = ro.extras[SCALE_KEY][0].item()
    part = ro.select([1])
    part.extras.pop(SCALE_KEY)
    assert term._scale(part, part.row_mask)[0].item() != whole


def test_stats_validation_and_rewards_needed():
    _, _, ro, term = _run(S, R)
    _close(term.stats(ro, {"logp": torch.tensor([S])[..., None]})["score"], [S])
    for params, match in (({"tau": 0.0}, "tau"), ({"norm": "groups"}, "norm"), ({"margin": float("inf")}, "finite")):
        with pytest.raises(ValueError, match=match):
            build("objective", "conspo", **params)
    ro.rewards = None
    ro.extras.pop(SCALE_KEY)
    with pytest.raises(ValueError, match="rewards"):
        term(ro, {"logp": torch.zeros(1, 4, 1)}, info_for(1))


# ---------------------------------------------------------------------------------------------- training
def test_two_steps_with_the_margin_curriculum(tmp_path):
    # margin linear 0 → .05 over 1 step: 0 at step 0, .05 at step 1 (logged as coef/conspo.margin)
    rows, seen = train_recorded(
        tmp_path,
        "conspo",
        "rollout.group_size=8",
        'objective.terms.conspo.margin={schedule="linear", start_value=0.0, end=0.05, steps=1}',
    )
    assert [r["coef/conspo.margin"] for r in rows] == [0.0, 0.05]
    # step 0 is on-policy: the step's loss is the ConSPO loss of the batch under the sampling weights (KL = 0)
    batch = seen[0]
    want, _ = conspo_loss(batch.logp_old, batch.row_mask, batch.rewards, tau=0.1, margin=0.0)
    assert want > 0 and rows[0]["loss"] == pytest.approx(float(want), abs=1e-5)
