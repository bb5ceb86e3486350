"""RSPO (specs/41), text form: the squared gap between the group-centred log-ratio to the reference and adv/β.

Spec unit test: G = 4, rewards [1, 0, 0, 1], β = 1 → A = r − mean r = [.5, −.5, −.5, .5] (``dr_grpo``);
u = [.2, .1, −.3, 0] (mean 0) → gap = u − A = [−.3, .6, .2, −.5];
loss = (.09 + .36 + .04 + .25)/4 = .185; ∂L/∂u = (2/4)(gap − mean gap) = gap/2 = [−.15, .30, .10, −.25].
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_micro_batching, info_for, leaf, make_rollout, objective_for, rollout_from, train_recorded

from groupwise.losses.rspo import huber, rspo_gap
from groupwise.registry import build
from groupwise.types import Need

U = [0.2, 0.1, -0.3, 0.0]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _group(u, rewards, adv=None, T=2):
    """One group whose rows have Σ_t (logp − logp_ref) = u: logp_ref = −2 per token, logp = −2 + u/T."""
    G = len(u)
    ro = rollout_from(torch.zeros(1, G, T), None, rewards=torch.tensor([rewards]), logp_ref=torch.full((1, G, T), -2.0))
    ro.advantages = build("advantage", "dr_grpo")(ro, info_for(T)) if adv is None else torch.tensor([adv])
    return ro, leaf([[[-2.0 + v / T] * T for v in u]])


def _loss_grad(term, ro, logp):
    obj = objective_for([term], "seq_mean_token_mean")
    info = info_for(ro.shape[2])
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad[..., 0]  # each row's tokens share ∂L/∂u (∂u/∂logp_t = 1)


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_loss_and_gradient():
    ro, logp = _group(U, REWARDS)
    _close(ro.advantages, [[0.5, -0.5, -0.5, 0.5]])
    L, grad = _loss_grad(build("objective", "rspo"), ro, logp)
    _close(L, 0.185)
    _close(grad, [[-0.15, 0.30, 0.10, -0.25]])
    _close(
        rspo_gap(torch.tensor([U]), ro.advantages, torch.ones(1, 4, dtype=torch.bool), 1.0), [[-0.3, 0.6, 0.2, -0.5]]
    )


def test_centring_beta_and_its_gradient():
    # a common shift of u changes nothing with centring: u + .5 → the spec's loss and gradient
    ro, logp = _group([v + 0.5 for v in U], REWARDS)
    L, grad = _loss_grad(build("objective", "rspo"), ro, logp)
    _close(L, 0.185)
    _close(grad, [[-0.15, 0.30, 0.10, -0.25]])
    # center = false: gap = u − A = [.2, 1.1, .7, 0] → loss (.04 + 1.21 + .49)/4 = .435, ∂L/∂u = gap/2
    L, grad = _loss_grad(build("objective", "rspo", center=False), ro, logp)
    _close(L, 0.435)
    _close(grad, [[0.1, 0.55, 0.35, 0.0]])
    # A = [1, 0, 0, 0], β = 2 → τ = [.5, 0, 0, 0]; gap = [−.3, .1, −.3, 0], mean −.125 (centring not neutral):
    # loss (.09 + .01 + .09)/4 = .0475; ∂L/∂u = (2/4)(gap + .125) = [−.0875, .1125, −.0875, .0625]
    ro, logp = _group(U, REWARDS, adv=[1.0, 0.0, 0.0, 0.0])
    L, grad = _loss_grad(build("objective", "rspo", beta=2.0), ro, logp)
    _close(L, 0.0475)
    _close(grad, [[-0.0875, 0.1125, -0.0875, 0.0625]])


def test_huber():
    # delta .4 on gaps [−.3, .6, .2, −.5]: [.09, 2·.4·.6 − .16 = .32, .04, 2·.4·.5 − .16 = .24] → mean .1725;
    # ∂/∂gap = [2·−.3, .8, 2·.2, −.8]/4 = [−.15, .2, .1, −.2], mean −.0125 → ∂L/∂u = [−.1375, .2125, .1125, −.1875]
    ro, logp = _group(U, REWARDS)
    L, grad = _loss_grad(build("objective", "rspo", huber_delta=0.4), ro, logp)
    _close(L, 0.1725)
    _close(grad, [[-0.1375, 0.2125, 0.1125, -0.1875]])
    x = torch.tensor([0.4, -0.4], requires_grad=True)  # at the joint: value δ² and slope 2δ from both sides
    huber(x, 0.4).sum().backward()
    _close(huber(x.detach(), 0.4), [0.16, 0.16])
    _close(x.grad, [0.8, -0.8])


# ---------------------------------------------------------------------------------------------- edge cases
def test_invalid_nan_and_empty_rows_are_left_out():
    # the spec's group + an invalid row, a NaN reward and an empty completion (huge u on each)
    ro, logp = _group(
        [*U, 9.0, 9.0, 9.0], [*REWARDS, 1.0, float("nan"), 1.0], adv=[0.5, -0.5, -0.5, 0.5, 3.0, 0.0, 3.0]
    )
    ro.group_valid[0, 4] = False
    ro.mask[0, 6] = False
    L, grad = _loss_grad(build("objective", "rspo"), ro, logp)
    # the group mean is over the 4 spec rows only (gap as the spec's); the NaN row counts in the row mean as 0:
    # loss .74/5 = .148, ∂L/∂u = (2/5)·gap = [−.12, .24, .08, −.2]
    _close(L, 0.148)
    _close(grad, [[-0.12, 0.24, 0.08, -0.2, 0.0, 0.0, 0.0]])


def test_constant_group_single_row_and_token_advantages():
    # constant group: A = 0 → loss = mean ubar² = (.04 + .01 + .09 + 0)/4 = .035, ∂L/∂u = ubar/2
    ro, logp = _group(U, [1.0] * 4)
    assert torch.equal(ro.advantages, torch.zeros(1, 4))
    L, grad = _loss_grad(build("objective", "rspo"), ro, logp)
    _close(L, 0.035)
    _close(grad, [[0.1, 0.05, -0.15, 0.0]])
    # one row: ubar = 0 → loss τ² = .49 and no gradient
    ro, logp = _group([0.3], [1.0], adv=[0.7])
    L, grad = _loss_grad(build("objective", "rspo"), ro, logp)
    _close(L, 0.49)
    assert torch.equal(grad, torch.zeros(1, 1))
    # token-level advantages: averaged over the row's tokens into the same per-row target
    ro, logp = _group(U, REWARDS)
    ro.advantages = torch.tensor([[[0.4, 0.6], [-0.5, -0.5], [-1.0, 0.0], [0.5, 0.5]]])  # row means = spec A
    _close(_loss_grad(build("objective", "rspo"), ro, logp)[0], 0.185)


def test_micro_batching_invariance():
    ro = make_rollout(6, 4, 5, seed=4)  # awkward rows and garbage padding
    check_micro_batching(
        objective_for([build("objective", "rspo")], "seq_mean_token_mean"), ro, [[3], [0, 5], [1, 2, 4]], info_for(5)
    )


def test_declaration_and_errors():
    term = build("objective", "rspo")
    assert term.needs == (Need("logp", model="ref"),) and term.agg == "seq_mean_token_mean"
    for key, bad in (("beta", 0.0), ("huber_delta", -1.0)):
        with pytest.raises(ValueError, match=key):
            build("objective", "rspo", **{key: bad})
    ro, logp = _group(U, REWARDS)
    ro.logp_ref = None
    with pytest.raises(ValueError, match="logp_ref"):
        term(ro, {"logp": logp}, info_for(2))


# ---------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("estimator", ["grpo", "sign"])
def test_trains_with_advantage_estimators(tmp_path, estimator):
    rows, seen = train_recorded(tmp_path, "rspo", f'advantage.estimator="{estimator}"')
    # step 0 is scored before any update: the policy is the reference, u = 0, so |gap| = |adv| / β per row
    batch = seen[0]
    counted = batch.row_mask.any(-1)  # [B,G] the rows the statistics average over
    expected = float(batch.advantages.abs()[counted & torch.isfinite(batch.rewards)].sum()) / float(counted.sum())
    assert expected > 0.1
    assert rows[0]["rspo/abs_gap"] == pytest.approx(expected, abs=1e-4)
    assert abs(rows[0]["rspo/log_ratio"]) < 1e-4
