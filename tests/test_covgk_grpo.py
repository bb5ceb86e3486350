"""CovGK-GRPO (specs/33): Gaussian-kernel token weights of the (logp, A) covariance contribution, by hand.

Spec unit test (4 valid tokens, population std)::

    logp = [-.1, -2, -.5, -1]   mean -.9   → logp − mean = [.8, -1.1, .4, -.1]
    A    = [1, 1, -1, -1]       mean 0
    c    = [.8, -1.1, -.4, .1]  mu_c = -.6/4 = -.15;  c − mu_c = [.95, -.95, -.25, .25]
    sig_c² = (2·.9025 + 2·.0625)/4 = .4825  (sig_c = .69462)
    w    = exp(-.9025/.965) = exp(-.93523) = .3925;  exp(-.0625/.965) = exp(-.06477) = .9373
    Ã    = w·A = [.3925, .3925, -.9373, -.9373]
"""

from __future__ import annotations

import pytest
import torch
from helpers import info_for, rollout_from, train_recorded

from groupwise.registry import build
from groupwise.types import Need
from groupwise.weights.covgk_grpo import cov_gaussian_weights

LOGP = [[-0.1, -2.0], [-0.5, -1.0]]  # rows: A = +1, A = −1
W = [[0.3925, 0.3925], [0.9373, 0.9373]]


def _spec_rollout(T_extra: int = 0):
    """B=1, G=2, T=2(+T_extra masked tokens of garbage): the spec's 4 tokens."""
    logp = torch.tensor([LOGP], dtype=torch.float32)  # [1,2,2]
    mask = torch.ones(1, 2, 2 + T_extra, dtype=torch.bool)
    if T_extra:
        logp = torch.cat([logp, torch.full((1, 2, T_extra), 55.0)], -1)  # [1,2,2+T_extra] garbage beyond the mask
        mask[..., 2:] = False
    return rollout_from(logp, torch.tensor([[1.0, -1.0]]), mask=mask, rewards=torch.tensor([[1.0, 0.0]]))


def _w(ro, **params):
    return build("weight", "covgk_grpo", **params)(ro, info_for(ro.shape[2]))


def _close(actual, expected, atol=1e-4):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_weights():
    w = _w(_spec_rollout())
    assert w.shape == (1, 2, 2) and w.dtype == torch.float32
    _close(w, [W])
    w_fn, c = cov_gaussian_weights(
        torch.tensor([-0.1, -2.0, -0.5, -1.0]), torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.zeros(4, dtype=torch.long)
    )
    _close(c, [0.8, -1.1, -0.4, 0.1], atol=1e-7)
    _close(w_fn, [0.3925, 0.3925, 0.9373, 0.9373])


def test_weighted_ppo_clip_is_the_surrogate_with_reweighted_advantage():
    # on-policy, ∂(w · ppo_clip)/∂logp = −w·A = −Ã = [-.3925, -.3925, .9373, .9373] per token
    ro = _spec_rollout()
    w = _w(ro)
    logp = ro.logp_old.clone().requires_grad_(True)
    values = build("objective", "ppo_clip")(ro, {"logp": logp}, info_for(2)) * w  # [1,2,2]
    (grad,) = torch.autograd.grad(values.sum(), logp)
    _close(grad, [[[-0.3925, -0.3925], [0.9373, 0.9373]]])


def test_options_by_hand():
    ro = _spec_rollout()
    # center="zero": exp(−c²/(2·.4825)): .64/.965 → .5152, 1.21/.965 → .2854, .16/.965 → .8472, .01/.965 → .9897
    _close(_w(ro, center="zero"), [[[0.5152, 0.2854], [0.8472, 0.9897]]])
    # bandwidth="rms": sig² = mean c² = (.64 + 1.21 + .16 + .01)/4 = .505 →
    # exp(−.9025/1.01) = .4092, exp(−.0625/1.01) = .9400
    _close(_w(ro, bandwidth="rms"), [[[0.4092, 0.4092], [0.9400, 0.9400]]])


def test_zero_advantage_tokens_enter_the_statistics_unless_excluded():
    # group 1: one row with A = 0 (constant group), logp [-.9, -.9]; its other row invalid (garbage)
    # all 6 tokens: means stay −.9 and 0, so c = [.8, −1.1, −.4, .1, 0, 0]; mu = −.1
    # c − mu = [.9, −1, −.3, .2, .1, .1]; Σ² = .81 + 1 + .09 + .04 + .01 + .01 = 1.96 → sig² = .326667
    # w = exp(−.81/.653333) = .2894, exp(−1/.653333) = .2164, exp(−.09/.653333) = .8713, exp(−.04/.653333) = .9406,
    #     exp(−.01/.653333) = .9848
    logp = torch.tensor([LOGP, [[-0.9, -0.9], [40.0, -40.0]]])  # [2,2,2]
    ro = rollout_from(logp, torch.tensor([[1.0, -1.0], [0.0, 0.0]]), rewards=torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    ro.group_valid[1, 1] = False
    _close(_w(ro), [[[0.2894, 0.2164], [0.8713, 0.9406]], [[0.9848, 0.9848], [0.0, 0.0]]])
    # stats_tokens="nonzero_adv": only the spec's 4 tokens → the spec weights; the A = 0 tokens get 1
    _close(_w(ro, stats_tokens="nonzero_adv"), [W, [[1.0, 1.0], [0.0, 0.0]]])


def test_stats_scope_group_and_sequence():
    # group 1 = group 0 with logp shifted by −3 and A ×5: per group the weights are the spec's (shift- and
    # scale-free); over the batch they are not (the shift moves mean(logp) between the groups)
    logp = torch.tensor([LOGP, [[-3.1, -5.0], [-3.5, -4.0]]])  # [2,2,2]
    ro = rollout_from(logp, torch.tensor([[1.0, -1.0], [5.0, -5.0]]), rewards=torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    _close(_w(ro, stats_scope="group"), [W, W])
    assert (_w(ro) - torch.tensor([W, W])).abs().max() > 0.05
    # sequence scope with sequence-level A: A − mean(A) = 0 within a row → c = 0 → w ≡ 1
    assert torch.equal(_w(ro, stats_scope="sequence"), torch.ones(2, 2, 2))


# ---------------------------------------------------------------------------------------------- invariants, edge cases
def test_constant_c_single_token_and_scale_invariance():
    ro = _spec_rollout()
    ro.advantages = torch.tensor([[0.7, 0.7]])  # A constant → A − mean = 0 exactly → c ≡ 0 → w ≡ 1
    assert torch.equal(_w(ro), torch.ones(1, 2, 2))
    one = _spec_rollout()
    one.mask[0, 0, 1] = False
    one.mask[0, 1] = False  # a single valid token: sig_c = 0 → w = 1 there, 0 off the mask
    assert torch.equal(_w(one), torch.tensor([[[1.0, 0.0], [0.0, 0.0]]]))
    scaled = _spec_rollout()
    scaled.advantages = scaled.advantages * 10  # c ×10, mu and sig ×10: w unchanged
    scaled.logp_old = scaled.logp_old - 2.0  # a shift of every logp moves only mean(logp)
    torch.testing.assert_close(_w(scaled), _w(_spec_rollout()), atol=1e-6, rtol=0)


def test_masked_tokens_invalid_rows_and_nan_rewards_are_ignored():
    w = _w(_spec_rollout(T_extra=2))  # two masked tokens with logp = 55 on each row
    _close(w[..., :2], [W])
    assert torch.equal(w[..., 2:], torch.zeros(1, 2, 2))
    # a second group: one row invalid, one with a NaN reward and wild logp; neither enters the statistics
    logp = torch.tensor([LOGP, [[30.0, -30.0], [-7.0, 9.0]]])  # [2,2,2]
    ro = rollout_from(
        logp, torch.tensor([[1.0, -1.0], [4.0, 0.0]]), rewards=torch.tensor([[1.0, 0.0], [float("nan"), 1.0]])
    )
    ro.group_valid[1, 1] = False
    w2 = _w(ro)
    _close(w2[0], W)
    assert torch.equal(w2[1, 1], torch.zeros(2))  # group_valid False: exactly 0
    # NaN reward: out of the statistics, left at 1 (its A is 0 from any estimator)
    assert torch.equal(w2[1, 0], torch.ones(2))
    assert torch.isfinite(w2).all()


def test_token_advantages_and_stats():
    ro = _spec_rollout()
    cov = build("weight", "covgk_grpo")
    seq = cov(ro, info_for(2))
    ro.advantages = ro.advantages[..., None].expand(1, 2, 2).clone()  # the same advantages per token
    torch.testing.assert_close(cov(ro, info_for(2)), seq)
    s = cov.step_stats()
    # cov = mean c = −.15; w_mean = (2·.3925 + 2·.9373)/4 = .6649; w < .5 for 2 of 4 tokens
    assert s["covgk/cov"] == pytest.approx(-0.15, abs=1e-6) and s["covgk/w_mean"] == pytest.approx(0.6649, abs=1e-4)
    assert s["covgk/low_frac"] == 0.5 and s["covgk/w_min"] == pytest.approx(0.3925, abs=1e-4)


def test_declaration_and_errors():
    cov = build("weight", "covgk_grpo")
    assert cov.needs == (Need("logp"),) and cov.scope == "loss"
    for key in ("center", "bandwidth", "stats_scope", "stats_tokens"):
        with pytest.raises(ValueError, match=key):
            build("weight", "covgk_grpo", **{key: "nope"})
    ro = _spec_rollout()
    ro.logp_old = None
    with pytest.raises(ValueError, match="Need\\('logp'\\)"):
        cov(ro, info_for(2))
    ro = _spec_rollout()
    ro.advantages = None
    with pytest.raises(ValueError, match="estimator"):
        cov(ro, info_for(2))


# ---------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_on_the_embedded_model(tmp_path, objective):
    rows, seen = train_recorded(tmp_path, objective, 'objective.weights=["covgk_grpo"]', "rollout.group_size=8")
    acted = False
    for row, batch in zip(rows, seen):
        # recomputed from the batch's logp_old and A
        want = build("weight", "covgk_grpo")(batch, info_for(batch.shape[2]))
        torch.testing.assert_close(batch.weight, want)
        mask = batch.row_mask
        assert (batch.weight[~mask] == 0).all() and (batch.weight[mask] > 0).all()
        assert row["covgk/w_mean"] == pytest.approx(float(want[mask].mean()), abs=1e-6)
        acted |= bool(batch.weight[mask].min() < 0.9)  # some token really down-weighted
    assert acted
