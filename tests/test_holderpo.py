"""HölderPO (specs/30), worked by hand. d = logp − logp_old = [.1, −.2, .3], all tokens in::

    p = 2:   sqrt(mean(e^.2, e^−.4, e^.6)) = sqrt((1.221403 + .670320 + 1.822119)/3) = sqrt(1.237947) = 1.112631
    p = 1:   mean(e^.1, e^−.2, e^.3) = (1.105171 + .818731 + 1.349859)/3                         = 1.091253
    p = 0:   exp(mean d) = exp(.2/3) = exp(.066667)                                              = 1.068939
    p = −1:  1 / mean(e^−.1, e^.2, e^−.3) = 1 / .955689 ... = 1.046369;   p = −2:              1.024296
    loss (A = +1, p = 1): rho = 1.091 < 1.2 → −1.091253;   d = [.5, .5, .5]: rho = e^.5 = 1.6487 → clip → −1.2

Gradient (hand-derived): ∂rho/∂d_t = rho^(1−p)·r_t^p / L = rho·w_t, w = softmax_t(p·d):
    p = 2:  w = [.328879, .180492, .490629] → rho·w = [.365920, .200821, .545889]
    p = 0:  w = 1/3                         → rho·w = .356313 each
    p = −2: w = [.286333, .521732, .191935] → rho·w = [.293290, .534409, .196598]

Variants (p = 1, eps = .2, log 1.2 = .182322), d = [.5, 0, −.1]:
    sequence:        mean(1.648721, 1, .904837) = 1.184520 (< 1.2: unclipped)          → A = +1: −1.184520
    sequence_w_clip: d → [.182322, 0, −.1] → mean(1.2, 1, .904837) = 1.034946          → A = +1: −1.034946
    holder_token:    A = +1: min(r, 1.2) → the same 1.034946                              → −1.034946
    d = [−.5, 0, .1], A = −1: sequence mean(.606531, 1, 1.105171) = .903901 → +.903901;
                     holder_token max(r, .8) → mean(.8, 1, 1.105171) = .968390            → +.968390
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    assert_micro_batch_invariant,
    info_for,
    leaf,
    make_logp,
    make_rollout,
    objective_for,
    rollout_from,
    train_recorded,
)

from groupwise.losses.holderpo import P_KINDS, holder_p_schedule, holder_p_table, holder_po_loss, holder_ratio
from groupwise.registry import build

D = [0.1, -0.2, 0.3]
RATIO = {2: 1.112631, 1: 1.091253, 0: 1.068939, -1: 1.046369, -2: 1.024296}
GRAD = {2: [0.365920, 0.200821, 0.545889], 0: [0.356313] * 3, -2: [0.293290, 0.534409, 0.196598]}


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def _ro(d, adv, mask=None):
    """One group of len(d) rows of T tokens, logp_old = −1, so that logp = −1 + d."""
    d = torch.as_tensor(d, dtype=torch.float32)  # [G,T]
    # [1,G,T]
    return rollout_from(torch.full((1, *d.shape), -1.0), torch.tensor([adv], dtype=torch.float32), mask=mask), d[None]


def _loss(d, adv, agg="seq_mean_token_mean", mask=None, **params):
    ro, dd = _ro(d, adv, mask)
    logp = (ro.logp_old + dd).requires_grad_(True)  # [1,G,T]
    obj = objective_for([build("objective", "holderpo", **params)], agg)
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(dd.shape[-1])), info_for(dd.shape[-1]))
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_ratios():
    d = torch.tensor([[D]])  # [1,1,3]
    mask = torch.ones(1, 1, 3, dtype=torch.bool)
    for p, want in RATIO.items():
        _close(holder_ratio(d, torch.zeros_like(d), mask, float(p)), [[want]])


def test_power_mean_inequality_monotone_in_p():
    g = torch.Generator().manual_seed(0)
    d = torch.randn(20, 7, generator=g)[None] * 0.7  # [1,20,7]
    mask = torch.rand(1, 20, 7, generator=g) < 0.8
    mask[..., 0] = True
    ps = [-6.0, -2.0, -1.0, -0.3, 0.0, 1e-3, 0.5, 1.0, 2.0, 6.0]
    rhos = torch.stack([holder_ratio(d, torch.zeros_like(d), mask, p) for p in ps])  # [P,1,20]
    assert ((rhos[1:] - rhos[:-1]) >= -1e-6).all()
    assert (rhos[-1] - rhos[0] > 0.1).any()  # not all equal: the rows' ratios do differ


def test_spec_losses():
    loss, _ = _loss([D], [1.0], p=1.0)
    _close(loss, -1.091253)
    loss, grad = _loss([[0.5, 0.5, 0.5]], [1.0], p=1.0)  # rho = e^.5 = 1.6487 > 1.2: clipped, no gradient
    _close(loss, -1.2)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_spec_schedule():
    assert [
        holder_p_schedule(s, "linear_dec", p_min=-2.0, p_max=2.0, steps=500) for s in (0, 250, 500, 1000)
    ] == pytest.approx([2.0, 0.0, -2.0, -2.0], abs=1e-12)
    assert holder_p_schedule(250, "cos", steps=500) == pytest.approx(0.0, abs=1e-12)


def test_every_schedule_kind_by_hand():
    # u = 125/500 = .25, p_min = −2, p_max = 2, mid 0, amp 2: cos(π/4) = .707107, (2u − 1)³ = −.125, u² = .0625
    want = {
        "constant": 2.0,
        "linear": -1.0,
        "linear_dec": 1.0,
        "sin": -1.414214,
        "cos": 1.414214,
        "quad": -1.75,
        "quad_dec": 1.75,
        "cubic": -0.25,
        "cubic_dec": 0.25,
    }
    assert set(want) == set(P_KINDS)
    for kind, value in want.items():
        assert holder_p_schedule(125, kind, steps=500) == pytest.approx(value, abs=1e-6), kind
    assert holder_p_schedule(125, "quad", steps=500, power=3.0) == pytest.approx(-2 + 4 * 0.25**3)
    assert holder_p_table("linear_dec", steps=0) == {"schedule": "linear", "start_value": 2.0, "end": -2.0, "steps": 0}
    with pytest.raises(ValueError, match="kind"):
        holder_p_table("exp")


# ---------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("p", [2, 0, -2])
def test_ratio_gradient_matches_the_hand_derived_one(p):
    logp_old = torch.zeros(1, 1, 3)
    logp = leaf([[D]])
    rho = holder_ratio(logp, logp_old, torch.ones(1, 1, 3, dtype=torch.bool), float(p))
    (grad,) = torch.autograd.grad(rho.sum(), logp)
    _close(grad, [[GRAD[p]]])
    # the same from the spec's closed form rho^(1−p)·r_t^p / L
    r = [math.exp(x) for x in D]
    spec = [RATIO[p] ** (1 - p) * rt**p / 3 for rt in r]
    _close(grad, [[spec]], atol=2e-6)


def test_loss_gradient_is_minus_adv_times_the_ratio_gradient_when_unclipped():
    loss, grad = _loss([D], [0.5], p=2.0)  # rho = 1.1126 inside [.8, 1.2]
    _close(loss, -0.5 * 1.112631)
    _close(grad, [[[-0.5 * g for g in GRAD[2]]]])


@pytest.mark.parametrize("variant", ["sequence", "sequence_w_clip", "holder_token"])
@pytest.mark.parametrize("p", [2.0, 0.0, -2.0])
def test_on_policy_gradient_is_reinforce(variant, p):
    ro = make_rollout(3, 4, 5, seed=2)
    logp = make_logp(ro)
    ro.logp_old = torch.where(ro.mask, logp.detach(), ro.logp_old)
    grads = []
    for term in (build("objective", "holderpo", p=p, variant=variant), build("objective", "reinforce")):
        obj = objective_for([term], "seq_mean_token_mean")
        loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(5)), info_for(5))
        grads.append(torch.autograd.grad(loss, logp)[0])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-7, rtol=1e-6)
    assert grads[1].abs().sum() > 0


# ---------------------------------------------------------------------------------------------- variants
def test_variants_by_hand():
    d = [[0.5, 0.0, -0.1]]
    _close(_loss(d, [1.0], p=1.0)[0], -1.184520)
    _close(_loss(d, [1.0], p=1.0, variant="sequence_w_clip")[0], -1.034946)
    _close(_loss(d, [1.0], p=1.0, variant="holder_token")[0], -1.034946)
    d = [[-0.5, 0.0, 0.1]]
    _close(_loss(d, [-1.0], p=1.0)[0], 0.903901)
    _close(_loss(d, [-1.0], p=1.0, variant="holder_token")[0], 0.968390)
    # holder_token, A = +1: the capped token (d = .5 > log 1.2) gets no gradient, the others do
    _, grad = _loss([[0.5, 0.0, -0.1]], [1.0], p=1.0, variant="holder_token")
    assert grad[0, 0, 0] == 0 and (grad[0, 0, 1:] != 0).all()


def test_p_zero_is_gspo_with_the_same_clip():
    ro = make_rollout(3, 4, 5, seed=4)
    base = make_logp(ro, scale=0.15).detach()  # ratios spread around the 0.2 clip
    out = []
    for term in (build("objective", "holderpo", p=0.0), build("objective", "gspo", eps_low=0.2, eps_high=0.2)):
        logp = base.clone().requires_grad_(True)
        obj = objective_for([term], "seq_mean_token_mean")
        loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(5)), info_for(5))
        out.append((loss, torch.autograd.grad(loss, logp)[0]))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-7, rtol=1e-6)


def test_one_token_is_ppo_clip_for_any_p():
    ro = make_rollout(4, 5, 1, seed=3, awkward=False)
    logp = (
        ro.logp_old + 0.3 * torch.randn(ro.logp_old.shape, generator=torch.Generator().manual_seed(0))
    ).requires_grad_(True)
    want = build("objective", "ppo_clip")(ro, {"logp": logp}, info_for(1))[..., 0]  # [B,G]
    for p in (2.0, -1.0):
        got = build("objective", "holderpo", p=p)(ro, {"logp": logp}, info_for(1))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- edge cases
def test_masked_tokens_and_a_row_without_tokens():
    mask = torch.tensor([[[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]], dtype=torch.bool)
    d = [[0.1, -0.2, 0.3, 40.0, -60.0], [50.0, 50.0, 50.0, 50.0, 50.0]]  # garbage beyond the mask, an empty row
    _close(_loss(d, [1.0, 3.0], mask=mask, p=2.0)[0], -1.112631)  # row 0 alone (the empty row has no loss token)
    for variant in ("sequence", "sequence_w_clip", "holder_token"):
        loss, grad = _loss(d, [1.0, 3.0], mask=mask, p=2.0, variant=variant)
        clean, clean_grad = _loss([D], [1.0], p=2.0, variant=variant)
        _close(loss, float(clean.detach()))
        _close(grad[0, 0, :3], clean_grad[0, 0])
        assert torch.equal(grad[~mask], torch.zeros(int((~mask).sum())))
    ro, dd = _ro(d, [1.0, 3.0], mask)
    loss, rho = holder_po_loss(ro.logp_old + dd, ro.logp_old, mask, torch.tensor([[1.0, 0.0]]), 2.0)
    # an empty row: rho = 1, and with its adv 0 from row_advantages, loss 0
    assert rho[0, 1] == 1.0 and loss[0, 1] == 0.0


def test_zero_and_constant_advantages_give_exact_zero():
    ro = make_rollout(3, 4, 5, seed=6)
    ro.rewards = torch.ones(3, 4)
    ro.advantages = build("advantage", "grpo")(ro, info_for(5))  # constant groups: exactly 0
    logp = make_logp(ro)
    for p in (2.0, 0.0, -2.0):
        values = build("objective", "holderpo", p=p)(ro, {"logp": logp}, info_for(5))
        assert torch.equal(values, torch.zeros_like(values))
    ro = make_rollout(3, 4, 5, seed=6)  # NaN rewards from the sweep fixture: the estimator zeroes them
    ro.advantages = build("advantage", "grpo")(ro, info_for(5))
    values = build("objective", "holderpo")(ro, {"logp": logp}, info_for(5))
    assert torch.isfinite(values).all() and values[1, 0] == 0


def test_extreme_log_ratios_stay_finite_and_exact():
    # naive mean(exp(p·d)) overflows float32 at p·d > 88; the shifted form does not
    d = torch.tensor([[[45.0, -50.0, 44.0], [-45.0, -46.0, -80.0]]])  # [1,2,3]
    mask = torch.ones(1, 2, 3, dtype=torch.bool)
    for p in (2.0, -2.0, 1e-3):
        got = torch.log(holder_ratio(d, torch.zeros_like(d), mask, p))
        dd = d.double()
        want = (torch.logsumexp(p * dd, -1) - math.log(3)) / p
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-6)


def test_small_p_is_close_to_the_geometric_mean():
    d = torch.tensor([[D]])
    m = torch.ones(1, 1, 3, dtype=torch.bool)
    for p in (1e-5, -1e-5, 1e-7):
        _close(holder_ratio(d, torch.zeros_like(d), m, p), [[RATIO[0]]], atol=2e-6)


def test_micro_batching_invariance():
    B, G, T = 6, 4, 5
    ro = make_rollout(B, G, T, seed=5)
    logp = make_logp(ro, scale=0.2)
    for agg in ("seq_mean_token_mean", "token_mean", "group_mean"):
        for variant in ("sequence", "holder_token"):
            assert_micro_batch_invariant(build("objective", "holderpo", p=-1.5, variant=variant), agg, ro, logp)


def test_stats():
    term = build("objective", "holderpo", p=1.0)
    ro, dd = _ro([[0.5, 0.5, 0.5], D, [-0.5, -0.5, -0.5]], [1.0, 1.0, -1.0])
    s = term.stats(ro, {"logp": ro.logp_old + dd})
    _close(s["ratio"], [[1.648721, 1.091253, 0.606531]])
    assert s["clip_high"].tolist() == [[1.0, 0.0, 0.0]] and s["clip_low"].tolist() == [[0.0, 0.0, 1.0]]
    s = build("objective", "holderpo", p=1.0, variant="holder_token").stats(ro, {"logp": ro.logp_old + dd})
    assert (
        s["clip_high"].shape == (1, 3, 3)
        and s["clip_high"][0, 0].tolist() == [1.0, 1.0, 1.0]
        and s["clip_low"][0, 2].tolist() == [1.0] * 3
    )


def test_validation():
    for params, match in (
        ({"variant": "token"}, "variant"),
        ({"p": float("nan")}, "p must"),
        ({"eps_low": 1.0}, "eps_low"),
    ):
        with pytest.raises(ValueError, match=match):
            build("objective", "holderpo", **params)


# ---------------------------------------------------------------------------------------------- training
def test_two_steps_with_the_annealed_p(tmp_path):
    # linear_dec over the 2-step run: p = 2 at step 0, 2 − 4·(1/2) = 0 at step 1, logged as coef/holderpo.p
    rows, seen = train_recorded(
        tmp_path, "holderpo", 'objective.terms.holderpo.p={schedule="linear", start_value=2.0, end=-2.0}'
    )
    assert [r["coef/holderpo.p"] for r in rows] == [2.0, 0.0]
    assert all(0.0 < r["ratio"] < 10.0 for r in rows)
