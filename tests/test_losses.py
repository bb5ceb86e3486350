"""Objective terms, KL estimators, the KL reward and aggregations, worked by hand.

Conventions: ``d = logp - logp_old`` per token, ``ratio = e^d``; losses are per token before
aggregation; gradients are d(Σ loss)/d(logp) per token unless an aggregation is named.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, leaf, make_rollout, objective_for, rollout_from

from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.types import Need

E05, E01, EM05 = math.exp(0.5), math.exp(0.1), math.exp(-0.5)  # 1.648721, 1.105171, 0.606531


def _term_grad(term, mb, logp):
    values = term(mb, {"logp": logp}, info_for(mb.shape[2]))
    (grad,) = torch.autograd.grad(values[mb.row_mask].sum(), logp)
    return values.detach(), grad


# ---------------------------------------------------------------------------------------------- ppo_clip
def _ppo_case():
    #        row:   0     1     2     3    4     5
    d = torch.tensor([0.5, -0.5, 0.1, 0.0, -0.5, 0.5]).view(1, 6, 1)  # logp - logp_old
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0, 1.0, -1.0]])
    return rollout_from(torch.zeros(1, 6, 1), adv), leaf(d)


def test_ppo_clip_by_hand():
    mb, logp = _ppo_case()
    values, grad = _term_grad(build("objective", "ppo_clip"), mb, logp)
    expected = [
        -1.2,  # row 0: ratio e^0.5=1.6487, A=+1 → clipped 1.2 → loss −1.2·A = −1.2
        0.8,  # row 1: ratio e^−0.5=0.6065, A=−1 → min(−0.6065, −0.8) = −0.8 → loss 0.8
        E01,  # row 2: ratio e^0.1=1.1052 inside [0.8,1.2] → loss −ratio·A = 1.1052
        -2.0,  # row 3: ratio 1, A=2 → loss −2
        -EM05,  # row 4: ratio 0.6065 < 0.8 but A>0: min(0.6065, 0.8) keeps the unclipped → −0.6065
        E05,  # row 5: ratio 1.6487 > 1.2 but A<0: min(−1.6487, −1.2) keeps the unclipped → 1.6487
    ]
    torch.testing.assert_close(values.flatten(), torch.tensor(expected))
    # d loss / d logp = −A·ratio where unclipped, 0 where the clip is active (rows 0, 1)
    torch.testing.assert_close(grad.flatten(), torch.tensor([0.0, 0.0, E01, -2.0, -EM05, E05]))


def test_ppo_dual_clip_by_hand():
    mb, logp = _ppo_case()
    term = build("objective", "ppo_clip", dual_clip=1.5)
    values, grad = _term_grad(term, mb, logp)
    # row 5: A=−1, loss 1.6487 > cap −c·A = 1.5 → loss 1.5 and no gradient; rows 1, 2 (A<0) are under the cap
    torch.testing.assert_close(values.flatten(), torch.tensor([-1.2, 0.8, E01, -2.0, -EM05, 1.5]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([0.0, 0.0, E01, -2.0, -EM05, 0.0]))
    stats = term.stats(mb, {"logp": logp})
    assert stats["clip_dual"].flatten().tolist() == [0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize("c", [1.0, 0.5, -3.0])
def test_ppo_dual_clip_must_exceed_one(c):
    with pytest.raises(ValueError, match="dual_clip"):
        build("objective", "ppo_clip", dual_clip=c)


def test_ppo_clip_stats_as_trl():
    mb, logp = _ppo_case()
    stats = build("objective", "ppo_clip").stats(mb, {"logp": logp})
    # low-clipped: A<0 and ratio < 0.8 → row 1 only (row 4 has ratio < 0.8 but A>0: not clipped)
    assert stats["clip_low"].flatten().tolist() == [0, 1, 0, 0, 0, 0]
    # high-clipped: A>0 and ratio > 1.2 → row 0 only (row 5 has ratio > 1.2 but A<0)
    assert stats["clip_high"].flatten().tolist() == [1, 0, 0, 0, 0, 0]
    torch.testing.assert_close(stats["ratio"].flatten(), torch.tensor([E05, EM05, E01, 1.0, EM05, E05]))
    assert "clip_dual" not in stats
    # through the objective the statistics are means over loss tokens: 1/6 each
    obj = objective_for([build("objective", "ppo_clip")])
    obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(1)), info_for(1))
    got = obj.pop_stats()
    assert got["clip_low"] == pytest.approx(1 / 6) and got["clip_high"] == pytest.approx(1 / 6)


def test_ppo_clip_higher_dapo():
    mb = rollout_from(torch.zeros(1, 1, 1), torch.tensor([[1.0]]))
    r = math.exp(0.24)  # 1.2712
    for eps_high, loss, g in [(0.2, -1.2, 0.0), (0.28, -r, -r)]:
        # ratio 1.2712, A=+1: above 1.2 → clipped (no grad); below 1.28 → unclipped −ratio, grad −ratio
        values, grad = _term_grad(build("objective", "ppo_clip", eps_high=eps_high), mb, leaf([[[0.24]]]))
        assert values.item() == pytest.approx(loss, rel=1e-6) and grad.item() == pytest.approx(g, rel=1e-6)


def test_ppo_ratio_exactly_on_clip_boundary():
    # upper: ratio = e^0.1 (float32) exactly equals 1 + eps_high; A=+1 → loss −ratio, full gradient −ratio
    r_hi = float(torch.exp(torch.tensor(0.1)))
    r_lo = float(torch.exp(torch.tensor(-0.1)))
    term = build("objective", "ppo_clip", eps_low=1.0 - r_lo, eps_high=r_hi - 1.0)
    mb = rollout_from(torch.zeros(1, 2, 1), torch.tensor([[1.0, -1.0]]))
    values, grad = _term_grad(term, mb, leaf([[[0.1], [-0.1]]]))
    # lower: ratio e^−0.1 = 1 − eps_low exactly, A=−1 → loss +ratio, full gradient +ratio
    torch.testing.assert_close(values.flatten(), torch.tensor([-r_hi, r_lo]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([-r_hi, r_lo]))
    stats = term.stats(mb, {"logp": leaf([[[0.1], [-0.1]]])})
    assert stats["clip_low"].sum() == 0 and stats["clip_high"].sum() == 0  # on the boundary ≠ clipped
    # just past the boundary the clip takes over: gradient 0
    _, grad_out = _term_grad(term, mb, leaf([[[0.1001], [-0.1001]]]))
    assert grad_out.abs().sum() == 0


def test_ppo_token_level_advantages_and_garbage_padding():
    # one row, tokens d = [0.5, 0.1, (masked)], A_t = [+1, −1, NaN]; logp_old NaN on the masked token
    logp_old = torch.tensor([[[0.0, 0.0, float("nan")]]])
    adv = torch.tensor([[[1.0, -1.0, float("nan")]]])
    mb = rollout_from(logp_old, adv, mask=torch.tensor([[[1, 1, 0]]]))
    logp = leaf([[[0.5, 0.1, 3.0]]])
    values = build("objective", "ppo_clip")(mb, {"logp": logp}, info_for(3))
    torch.testing.assert_close(values[0, 0, :2], torch.tensor([-1.2, E01]))  # clipped 1.2; inside → e^0.1
    assert torch.isfinite(values).all()
    obj = objective_for([build("objective", "ppo_clip")])
    loss = obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(3)), info_for(3))
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor((-1.2 + E01) / 2))  # token mean over 2 tokens
    torch.testing.assert_close(logp.grad[0, 0], torch.tensor([0.0, E01 / 2, 0.0]))


def test_ppo_needs_advantages_and_logp_old():
    mb = rollout_from(torch.zeros(1, 1, 1), None)
    with pytest.raises(ValueError, match="advantages"):
        build("objective", "ppo_clip")(mb, {"logp": leaf([[[0.0]]])}, info_for(1))
    mb = rollout_from(torch.zeros(1, 1, 1), torch.ones(1, 1))
    mb.logp_old = None
    with pytest.raises(ValueError, match="logp_old"):
        build("objective", "ppo_clip")(mb, {"logp": leaf([[[0.0]]])}, info_for(1))


# ---------------------------------------------------------------------------------------------- gspo
def test_gspo_by_hand():
    # one row, tokens d = [0.2, −0.1, (masked 5.0)] → log_s = (0.2 − 0.1)/2 = 0.05, s = e^0.05 = 1.051271
    s = math.exp(0.05)
    mb = rollout_from(torch.zeros(1, 1, 3), torch.tensor([[1.0]]), mask=torch.tensor([[[1, 1, 0]]]))
    logp = leaf([[[0.2, -0.1, 5.0]]])
    # paper defaults eps = (3e-4, 4e-4): s = 1.0513 > 1.0004, A=+1 → clipped: loss −1.0004, no gradient
    values, grad = _term_grad(build("objective", "gspo"), mb, logp)
    torch.testing.assert_close(values[0, 0, :2], torch.tensor([-1.0004, -1.0004]))
    assert grad.abs().sum() == 0
    # wide clip (0.2): unclipped, every token's loss is −s·A, d loss_t / d logp_t = −A·s (GSPO-token)
    term = build("objective", "gspo", eps_low=0.2, eps_high=0.2)
    values, grad = _term_grad(term, mb, logp)
    torch.testing.assert_close(values[0, 0, :2], torch.tensor([-s, -s]))
    torch.testing.assert_close(grad[0, 0], torch.tensor([-s, -s, 0.0]))
    # seq_mean_token_mean: loss = −s; d/d logp_t = −s/2 = −0.525636 = ∂/∂logp_t of −A·exp(mean_t d)
    obj = objective_for([term], "seq_mean_token_mean")
    loss = obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(3)), info_for(3))
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-s, rel=1e-6)
    torch.testing.assert_close(g[0, 0], torch.tensor([-s / 2, -s / 2, 0.0]))
    stats = term.stats(mb, {"logp": logp})
    torch.testing.assert_close(stats["ratio"][0, 0, :2], torch.tensor([s, s]))


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.2), (0.05, 0.08)])
def test_gspo_equals_sequence_objective_of_the_paper(eps):
    # J = 1/n Σ_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t (logp − logp_old)) with full autograd
    ro = make_rollout(4, 4, 6, seed=21, awkward=False)
    logp = (ro.logp_old + 0.1 * torch.randn(4, 4, 6, generator=torch.Generator().manual_seed(2))).requires_grad_(True)
    obj = objective_for([build("objective", "gspo", eps_low=eps[0], eps_high=eps[1])], "seq_mean_token_mean")
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(6)), info_for(6))
    (grad,) = torch.autograd.grad(loss, logp)
    m = ro.mask.float()
    s = torch.exp(((logp - ro.logp_old) * m).sum(-1) / m.sum(-1))  # [B,G]
    A = ro.advantages
    J = torch.minimum(s * A, s.clamp(1 - eps[0], 1 + eps[1]) * A).mean()
    (grad_ref,) = torch.autograd.grad(-J, logp)
    torch.testing.assert_close(loss, -J)
    torch.testing.assert_close(grad, grad_ref, atol=1e-7, rtol=1e-5)


def test_gspo_without_length_norm_is_the_whole_sequence_ratio():
    # tokens d = [0.2, −0.1, (masked 5.0)] → log_s = 0.2 − 0.1 = 0.1 (a sum, not a mean), s = e^0.1 = 1.105171
    s = math.exp(0.1)
    mb = rollout_from(torch.zeros(1, 1, 3), torch.tensor([[1.0]]), mask=torch.tensor([[[1, 1, 0]]]))
    logp = leaf([[[0.2, -0.1, 5.0]]])
    term = build("objective", "gspo", eps_low=0.2, eps_high=0.2, length_norm=False)
    values, grad = _term_grad(term, mb, logp)  # unclipped (s < 1.2): loss_t = −s·A, d/d logp_t = −s
    torch.testing.assert_close(values[0, 0, :2], torch.tensor([-s, -s]))
    torch.testing.assert_close(grad[0, 0], torch.tensor([-s, -s, 0.0]))
    # with eps 0.05 the ratio 1.105 > 1.05 is clipped: loss −1.05 per token, no gradient
    values, grad = _term_grad(build("objective", "gspo", eps_low=0.05, eps_high=0.05, length_norm=False), mb, logp)
    torch.testing.assert_close(values[0, 0, :2], torch.tensor([-1.05, -1.05]))
    assert grad.abs().sum() == 0
    with pytest.raises(ConfigError, match="length_norm=false is the whole row's ratio; use it with span='row'"):
        build("objective", "gspo", span="segment", length_norm=False)


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.05, 0.08)])
def test_gspo_without_length_norm_has_the_sequence_gradient_under_token_sums(eps):
    # J = 1/n Σ_i min(s_i A_i, clip(s_i) A_i), s_i = exp(Σ_t (logp − logp_old)): under seq_mean_token_sum the
    # gradient is ∇(−J) exactly (the value is |y_i| times each row's term)
    ro = make_rollout(4, 4, 6, seed=21, awkward=False)
    logp = (ro.logp_old + 0.05 * torch.randn(4, 4, 6, generator=torch.Generator().manual_seed(2))).requires_grad_(True)
    term = build("objective", "gspo", eps_low=eps[0], eps_high=eps[1], length_norm=False)
    obj = objective_for([term], "seq_mean_token_sum")
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(6)), info_for(6))
    (grad,) = torch.autograd.grad(loss, logp)
    m = ro.mask.float()
    s = torch.exp(((logp - ro.logp_old) * m).sum(-1))  # [B,G]
    A = ro.advantages
    J = torch.minimum(s * A, s.clamp(1 - eps[0], 1 + eps[1]) * A).mean()
    (grad_ref,) = torch.autograd.grad(-J, logp)
    torch.testing.assert_close(grad, grad_ref, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- reinforce
def test_reinforce_by_hand():
    # loss = −A·logp: A=2, logp=−0.5 → 1.0 (grad −2); A=−1, logp=−2 → −2.0 (grad +1)
    mb = rollout_from(torch.zeros(1, 2, 1), torch.tensor([[2.0, -1.0]]))
    values, grad = _term_grad(build("objective", "reinforce"), mb, leaf([[[-0.5], [-2.0]]]))
    torch.testing.assert_close(values.flatten(), torch.tensor([1.0, -2.0]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([-2.0, 1.0]))


# ---------------------------------------------------------------------------------------------- kl
@pytest.mark.parametrize(
    "name,value,grad",
    [
        # logp = −1, logp_ref = −1.5, d = logp_ref − logp = −0.5
        ("k1", 0.5, 1.0),  # logp − logp_ref = 0.5; d/dlogp = 1
        ("k2", 0.125, 0.5),  # ½·0.5² = 0.125; d/dlogp = logp − logp_ref = 0.5
        ("k3", EM05 + 0.5 - 1.0, 1.0 - EM05),  # e^−0.5 + 0.5 − 1 = 0.106531; d/dlogp = 1 − e^d = 0.393469
    ],
)
def test_kl_estimators_by_hand(name, value, grad):
    logp = leaf([-1.0])
    kl = build("kl", name)(logp, torch.tensor([-1.5]))
    kl.sum().backward()
    assert kl.item() == pytest.approx(value, rel=1e-6) and logp.grad.item() == pytest.approx(grad, rel=1e-6)


def test_kl_signs():
    # d = logp_ref − logp = +0.5: k1 = −0.5 (can be negative), k2 = 0.125, k3 = e^0.5 − 0.5 − 1 = 0.148721
    logp, ref = torch.tensor([-1.5]), torch.tensor([-1.0])
    assert build("kl", "k1")(logp, ref).item() == pytest.approx(-0.5)
    assert build("kl", "k2")(logp, ref).item() == pytest.approx(0.125)
    assert build("kl", "k3")(logp, ref).item() == pytest.approx(E05 - 1.5, rel=1e-6)


def test_kl_term_by_hand():
    term = build("objective", "kl")
    assert term.coef == 0.04 and term.estimator == "k3" and term.needs == (Need("logp", model="ref"),)
    # tokens: d = [−0.5, +0.5, masked]; k3 = [0.106531, 0.148721, 0]
    mb = rollout_from(
        torch.zeros(1, 1, 3),
        None,
        mask=torch.tensor([[[1, 1, 0]]]),
        logp_ref=torch.tensor([[[-1.5, -0.5, float("nan")]]]),
    )
    logp = leaf([[[-1.0, -1.0, 9.0]]])
    values = term(mb, {"logp": logp}, info_for(3))
    torch.testing.assert_close(values, torch.tensor([[[EM05 - 0.5, E05 - 1.5, 0.0]]]))
    obj = objective_for([term])
    loss = obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(3)), info_for(3))
    # token mean × β: 0.04 · (0.106531 + 0.148721)/2 = 0.005105
    assert loss.item() == pytest.approx(0.04 * (EM05 + E05 - 2.0) / 2, rel=1e-6)
    loss.backward()
    # d/dlogp = β/2 · (1 − e^d) = 0.02·[0.393469, −0.648721, 0]
    torch.testing.assert_close(logp.grad, torch.tensor([[[0.02 * (1 - EM05), 0.02 * (1 - E05), 0.0]]]))
    assert obj.pop_stats()["kl"] == pytest.approx((EM05 + E05 - 2.0) / 2, rel=1e-6)
    with pytest.raises(ConfigError):
        build("objective", "kl", estimator="k4")


def test_kl_penalty_reward_by_hand():
    scorer = build("reward", "kl_penalty")
    assert not callable(scorer)  # a scorer, not a text reward: the trainer tells them apart by score_rollout
    assert hasattr(scorer, "score_rollout") and scorer.coef == 0.05 and scorer.estimator == "k1"
    assert set(scorer.needs) == {Need("logp", "ref"), Need("logp", "policy")}
    logp_old = torch.tensor([[[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]]])
    logp_ref = torch.tensor([[[-1.5, -1.0, 7.0], [-1.5, -1.0, 7.0]]])
    mb = rollout_from(
        logp_old,
        None,
        mask=torch.tensor([[[1, 1, 0], [1, 1, 1]]]),
        logp_ref=logp_ref,
        group_valid=torch.tensor([[True, False]]),
    )
    # row 0: k1 = [0.5, −1.0] (third token masked) → Σ = −0.5 → score −0.05·(−0.5) = 0.025; row 1 invalid → 0
    torch.testing.assert_close(scorer.score_rollout(mb, info_for(3)), torch.tensor([[0.025, 0.0]]))
    # k3: [e^−0.5 + 0.5 − 1, e^1 − 1 − 1] = [0.106531, 0.718282] → Σ 0.824813 → −0.041241
    k3 = build("reward", "kl_penalty", estimator="k3")
    torch.testing.assert_close(
        k3.score_rollout(mb, info_for(3)), torch.tensor([[-0.05 * (EM05 - 0.5 + math.e - 2), 0.0]])
    )


# ---------------------------------------------------------------------------------------------- aggregation
VALUES = torch.tensor([[[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]]])  # [1,3,3]
MASK = torch.tensor([[[1, 1, 1], [1, 0, 0], [0, 0, 0]]], dtype=torch.bool)  # row 2 fully masked


@pytest.mark.parametrize(
    "name,params,expected",
    [
        ("token_mean", {}, 10 / 4),  # (1+2+3+4) / 4 tokens = 2.5
        ("seq_mean_token_mean", {}, 3.0),  # (mean(1,2,3)=2 + 4) / 2 rows with tokens = 3
        ("constant", {}, 10 / 8),  # 10 / (2 rows · max_new_tokens 4) = 1.25
        ("constant", {"max_len": 5}, 1.0),  # 10 / (2 · 5) = 1.0
    ],
)
def test_aggregation_by_hand(name, params, expected):
    agg = build("aggregation", name, **params)
    norm = agg.normalizer(MASK, info_for(4))
    assert agg.reduce(VALUES, MASK, norm).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("token_mean", (3 * 3 + 5 * 1) / 4),  # a row value counts once per loss token: 14/4 = 3.5
        ("seq_mean_token_mean", (3 + 5) / 2),  # = 4
        ("constant", (3 * 3 + 5 * 1) / (2 * 5)),  # 14/10 = 1.4
    ],
)
def test_aggregation_row_values_equal_broadcast_tokens(name, expected):
    agg = build("aggregation", name, **({"max_len": 5} if name == "constant" else {}))
    rows = torch.tensor([[3.0, 5.0, 100.0]])  # row 2 has no loss token: ignored
    norm = agg.normalizer(MASK, info_for(5))
    assert agg.reduce(rows, MASK, norm).item() == pytest.approx(expected)
    assert agg.reduce(rows[..., None].expand(1, 3, 3), MASK, norm).item() == pytest.approx(expected)


def test_aggregation_normalisers_are_integer_sums():
    info = info_for(4)
    assert build("aggregation", "token_mean").normalizer(MASK, info) == {"tokens": torch.tensor(4)}
    assert build("aggregation", "seq_mean_token_mean").normalizer(MASK, info) == {"rows": torch.tensor(2)}
    assert build("aggregation", "constant").normalizer(MASK, info) == {"slots": torch.tensor(8)}
    with pytest.raises(ValueError):
        build("aggregation", "constant", max_len=0)


def test_objective_weights_scale_values_and_leave_normaliser():
    # reinforce with A=1, logp = [−1,−2,−3] → values [1,2,3]; weights [1, 0.5, 0] → [1, 1, (removed)]
    mb = rollout_from(torch.zeros(1, 1, 3), torch.ones(1, 1), weight=torch.tensor([[[1.0, 0.5, 0.0]]]))
    logp = leaf([[[-1.0, -2.0, -3.0]]])
    obj = objective_for([build("objective", "reinforce")])
    loss = obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(3)), info_for(3))
    assert loss.item() == pytest.approx(1.0)  # token mean over the 2 tokens left: (1 + 1) / 2
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[[-0.5, -0.25, 0.0]]]))
