"""S-trace / P-trace (specs/58): eligibility-trace token ratios, by hand, and its two special cases.

Spec unit test, delta = logp − logp_old = [0.1, −0.2, 0.3] on one row::

    lam = 0.5: e = [0.1, (0.5·0.1 − 0.2)/1.5, (0.25·0.1 − 0.5·0.2 + 0.3)/1.75] = [0.1, −0.1, 0.128571]
               w = exp(e) = [1.105171, 0.904837, 1.137203]
    lam = 1:   e_3 = mean delta = 0.066667 → w_3 = 1.068939 (GSPO's sequence ratio)
    lam = 0:   w = exp(delta) = [1.105171, 0.818731, 1.349859] (PPO's token ratio)
    sel = [1, 0, 1], lam = 0.5: e = [0.1, 0.1 (carried), (0.25·0.1 + 0.3)/1.25 = 0.26] → [1.105171, 1.105171, 1.296930]
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    check_micro_batching,
    fill_needs,
    info_for,
    leaf,
    make_logp,
    make_rollout,
    objective_for,
    rollout_from,
    train_recorded,
)

from groupwise.losses.s_trace import trace_log_ratio
from groupwise.registry import build
from groupwise.types import Need

DELTA = [0.1, -0.2, 0.3]
W_HALF = [1.105171, 0.904837, 1.137203]


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _one_row(delta=DELTA, adv=1.0):
    """B=1, G=1: logp_old = 0, so logp = delta."""
    T = len(delta)
    return rollout_from(torch.zeros(1, 1, T), torch.tensor([[adv]])), leaf([[delta]])


def _values_grad(term, ro, logp):
    values = term(ro, {"logp": logp}, info_for(ro.shape[2]))
    (grad,) = torch.autograd.grad(values[ro.row_mask].sum(), logp)
    return values.detach(), grad


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_traces():
    d = torch.tensor(DELTA)
    every = torch.ones(3, dtype=torch.bool)
    _close(trace_log_ratio(d, every, 0.5).exp(), W_HALF)
    _close(trace_log_ratio(d, every, 1.0).exp()[-1], 1.068939)
    _close(trace_log_ratio(d, every, 0.0).exp(), [1.105171, 0.818731, 1.349859])
    _close(trace_log_ratio(d, torch.tensor([True, False, True]), 0.5).exp(), [1.105171, 1.105171, 1.296930])
    # no trace token yet → e = 0: sel = [0, 1, 0] → e = [0, −0.2, −0.2]
    _close(trace_log_ratio(d, torch.tensor([False, True, False]), 0.5), [0.0, -0.2, -0.2])


def test_term_value_and_gradient_through_the_trace():
    # p_trace, lam = 0.5, A = 1, no clip (eps 0.9): loss_t = −w_t; w_t = exp(e_t), e_t = Σ_k c_tk delta_k with
    # c = [[1], [1/3, 2/3], [1/7, 2/7, 4/7]]  →  ∂Σloss/∂delta_k = −Σ_{t>=k} w_t c_tk:
    #   k=1: −(1.105171 + 0.904837/3 + 1.137203/7) = −1.569241
    #   k=2: −(2·0.904837/3 + 2·1.137203/7) = −0.928140;  k=3: −4·1.137203/7 = −0.649830
    ro, logp = _one_row()
    term = build("objective", "s_trace", mode="p_trace", lam=0.5, eps_low=0.9, eps_high=0.9)
    values, grad = _values_grad(term, ro, logp)
    _close(values, [[[-w for w in W_HALF]]])
    _close(grad, [[[-1.569241, -0.928140, -0.649830]]])
    _close(term.stats(ro, {"logp": logp})["ratio"], [[W_HALF]])
    # trace_grad = "token": the same values, each token only its own ∇logp_t: −w_t
    values_tok, grad_tok = _values_grad(
        build("objective", "s_trace", mode="p_trace", lam=0.5, eps_low=0.9, eps_high=0.9, trace_grad="token"), ro, logp
    )
    _close(values_tok, values)
    _close(grad_tok, [[[-w for w in W_HALF]]])


def test_clipping_is_per_token():
    # eps 0.12, A = 1: w = [1.105171 (in), 0.904837 (in), 1.137203 > 1.12 → clipped at 1.12]
    # → only token 3 loses its own gradient; tokens 1, 2 still get theirs (and token 3's trace term is gone):
    #   k=1: −(1.105171 + 0.904837/3) = −1.406783;  k=2: −2·0.904837/3 = −0.603225;  k=3: 0
    ro, logp = _one_row()
    values, grad = _values_grad(
        build("objective", "s_trace", mode="p_trace", lam=0.5, eps_low=0.12, eps_high=0.12), ro, logp
    )
    _close(values, [[[-1.105171, -0.904837, -1.12]]])
    _close(grad, [[[-1.406783, -0.603225, 0.0]]])


def test_s_trace_selection_by_hand():
    # entropies [[.5, .1, .9], [.2, .8, .3]], rho = 0.5 → k = 3 of 6: .9, .8, .5 → sel [[1,0,1], [0,1,0]]
    # row 0 delta = DELTA → w = [1.105171, 1.105171, 1.296930]; row 1 delta = [.4, −.1, .2] → e = [0, −.1, −.1]
    ro = rollout_from(torch.zeros(1, 2, 3), torch.tensor([[1.0, -1.0]]))
    ro.set_extra("entropy", torch.tensor([[[0.5, 0.1, 0.9], [0.2, 0.8, 0.3]]]), "token")
    logp = leaf([[DELTA, [0.4, -0.1, 0.2]]])
    w = [[1.105171, 1.105171, 1.296930], [1.0, 0.904837, 0.904837]]
    term = build("objective", "s_trace", lam=0.5, rho=0.5, eps_low=0.9, eps_high=0.9)
    values, grad = _values_grad(term, ro, logp)
    # "selected": loss −A·w on trace tokens only; ∂/∂delta: row 0 k=1 −(w1 + 0.2·w3) = −1.364557,
    # k=3 −0.8·w3 = −1.037544;
    # row 1 (A = −1) k=2: +w2 = 0.904837; every non-trace token 0
    _close(values, [[[-1.105171, 0.0, -1.296930], [0.0, 0.904837, 0.0]]])
    _close(grad, [[[-1.364557, 0.0, -1.037544], [0.0, 0.904837, 0.0]]])
    stats = term.stats(ro, {"logp": logp})
    _close(stats["ratio"], [w])
    assert stats["trace_frac"].tolist() == [[[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]]
    # "all": every token bears −A·w; non-trace tokens pass their gradient to the trace tokens before them
    # row 0: k=1 −(w1 + w2 + 0.2·w3) = −2.469728, k=3 −0.8·w3; row 1: k=2 +(w2 + w3) = 1.809675, token 1 (e = 0): none
    values, grad = _values_grad(
        build("objective", "s_trace", lam=0.5, rho=0.5, eps_low=0.9, eps_high=0.9, loss_mask_mode="all"), ro, logp
    )
    _close(values, [[[-1.105171, -1.105171, -1.296930], [1.0, 0.904837, 0.904837]]])
    _close(grad, [[[-2.469728, 0.0, -1.037544], [0.0, 1.809675, 0.0]]])


# ---------------------------------------------------------------------------------------------- special cases
def _loss_and_grad(term, ro, logp_base, agg):
    logp = logp_base.clone().requires_grad_(True)
    obj = objective_for([term], agg)
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(ro.shape[2])), info_for(ro.shape[2]))
    loss.backward()
    return loss.detach(), logp.grad


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "constant", "seq_mean_token_sum"])
@pytest.mark.parametrize("token_adv", [False, True])
def test_lam_zero_p_trace_is_ppo_clip(agg, token_adv):
    ro = make_rollout(4, 5, 6, seed=3, token_adv=token_adv)  # awkward rows, garbage padding
    base = make_logp(ro, seed=4).detach()  # ratios 0.5–2: many tokens clipped
    eps = dict(eps_low=0.2, eps_high=0.28)
    l1, g1 = _loss_and_grad(build("objective", "s_trace", mode="p_trace", lam=0.0, **eps), ro, base, agg)
    l2, g2 = _loss_and_grad(build("objective", "ppo_clip", **eps), ro, base, agg)
    torch.testing.assert_close(l1, l2, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(g1, g2, atol=1e-7, rtol=1e-6)
    assert g1.abs().sum() > 0
    lam, _ = _loss_and_grad(build("objective", "s_trace", mode="p_trace", lam=0.5, **eps), ro, base, agg)
    assert not torch.allclose(lam, l2)  # guard: the trace does change the loss


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "constant"])
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.05)])
def test_lam_one_broadcast_is_gspo(agg, eps):
    # sequence advantage: e_{T-1} = mean_t delta = GSPO's log s_i on every token; the full-trace gradient
    # s·mean_k ∇logp_k summed over the row's tokens equals GSPO-token's Σ_t s·∇logp_t / |y| per row weight
    ro = make_rollout(4, 5, 6, seed=5)
    base = (ro.logp_old + 0.05 * torch.randn(ro.logp_old.shape, generator=torch.Generator().manual_seed(1))).detach()
    kw = dict(eps_low=eps[0], eps_high=eps[1])
    l1, g1 = _loss_and_grad(
        build("objective", "s_trace", mode="p_trace", lam=1.0, broadcast_last=True, **kw), ro, base, agg
    )
    l2, g2 = _loss_and_grad(build("objective", "gspo", **kw), ro, base, agg)
    torch.testing.assert_close(l1, l2, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(g1, g2, atol=1e-7, rtol=1e-5)
    assert g1.abs().sum() > 0
    if eps[0] == 0.05:  # some rows inside the range, some clipped: the comparison covers both
        log_s = build("objective", "gspo", **kw).stats(ro, {"logp": base})["ratio"]
        inside = ((log_s - 1).abs() <= 0.05) & ro.row_mask
        assert inside.any() and (~inside & ro.row_mask).any()


def test_lam_one_broadcast_token_grad_is_gspo_token_with_token_advantages():
    ro = make_rollout(4, 5, 6, seed=6, token_adv=True)
    base = make_logp(ro, seed=2, scale=0.02).detach()
    kw = dict(eps_low=0.01, eps_high=0.01)
    l1, g1 = _loss_and_grad(
        build("objective", "s_trace", mode="p_trace", lam=1.0, broadcast_last=True, trace_grad="token", **kw),
        ro,
        base,
        "token_mean",
    )
    l2, g2 = _loss_and_grad(build("objective", "gspo", **kw), ro, base, "token_mean")
    torch.testing.assert_close(l1, l2, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(g1, g2, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- scope, edge cases
def test_loss_invariant_to_micro_batching_after_prepare():
    B, G, T = 8, 4, 6
    ro = make_rollout(B, G, T, seed=7)
    term = build("objective", "s_trace")
    fill_needs(ro, term.needs)
    info = info_for(T)
    term.prepare(ro, info)  # whole-batch entropy threshold
    n = int(ro.row_mask.sum())
    assert ro.extras["s_trace.select"].float()[ro.row_mask].mean() == pytest.approx(math.ceil(0.2 * n) / n)
    obj = objective_for([term], "seq_mean_token_mean")
    split = [[0, 5], [1], [2, 3, 7], [4, 6]]
    whole, _ = check_micro_batching(obj, ro, split, info)
    # guard: without the whole-batch selection each micro-batch picks its own top 20 %
    ro.extras.pop("s_trace.select")
    logp = make_logp(ro)
    norms = obj.normalizers(ro, info)
    local = sum(obj.loss(ro.select(idx), {"logp": logp[idx]}, norms, info) for idx in split)
    assert not torch.allclose(local, whole)


def test_masked_tokens_empty_rows_nan_and_constant_groups():
    ro = make_rollout(3, 4, 6, seed=8)  # garbage padding, an invalid row, an empty row, a NaN reward
    ro.rewards[2] = 1.0  # group 2: constant → zero advantages
    ro.advantages = build("advantage", "grpo")(ro, info_for(6))
    term = build("objective", "s_trace", loss_mask_mode="all")
    fill_needs(ro, term.needs)
    ro.extras["entropy"][0, 1, 0] = float("nan")  # a non-finite entropy is never a trace token
    logp = make_logp(ro)
    values = term(ro, {"logp": logp}, info_for(6))
    (grad,) = torch.autograd.grad(values[ro.row_mask].sum(), logp)
    assert torch.isfinite(values).all() and torch.isfinite(grad).all()
    assert (grad[~ro.row_mask] == 0).all()  # padding, the invalid row, the empty row
    assert (values[2][ro.row_mask[2]] == 0).all() and (grad[2] == 0).all()  # constant group
    assert (values[1, 0] == 0).all()  # the NaN reward's row: advantage 0
    assert not term._selection(ro, info_for(6))[0, 1, 0]
    assert (grad[ro.row_mask] != 0).any()


def test_declaration_and_errors():
    assert build("objective", "s_trace").needs == (Need("entropy"),)
    assert build("objective", "s_trace", mode="p_trace").needs == ()
    assert not build("objective", "s_trace").on_policy_reinforce
    assert build("objective", "s_trace", mode="p_trace", lam=0.0).on_policy_reinforce
    assert build("objective", "s_trace", mode="p_trace", trace_grad="token").on_policy_reinforce
    for key, bad in (
        ("mode", "q_trace"),
        ("loss_mask_mode", "some"),
        ("trace_grad", "none"),
        ("lam", 1.5),
        ("rho", 0.0),
        ("eps_low", 1.0),
    ):
        with pytest.raises(ValueError, match=key):
            build("objective", "s_trace", **{key: bad})
    ro, logp = _one_row()
    with pytest.raises(ValueError, match="Need\\('entropy'\\)"):
        build("objective", "s_trace")(ro, {"logp": logp}, info_for(3))


# ---------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("estimator", ["grpo", "sign"])
def test_trains_with_advantage_estimators(tmp_path, estimator):
    rows, seen = train_recorded(tmp_path, "s_trace", f'advantage.estimator="{estimator}"')
    for row, batch in zip(rows, seen):
        n = int(batch.row_mask.sum())
        kept = int(batch.extras["s_trace.select"][batch.row_mask].sum())
        # the whole batch's top 20 % (k = ceil(0.2·n); rows sharing a prefix tie at the threshold, all kept)
        assert math.ceil(0.2 * n) <= kept < n
        assert row["trace_frac"] == pytest.approx(kept / n, abs=1e-6)  # what the loss used is what prepare chose
