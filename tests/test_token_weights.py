"""How token weights reach each objective term (issue 32): the declarations of ``objective.py``, worked by hand.

One row of 2 tokens, A = +1, on-policy (logp = logp_old, every ratio 1), unless a case says otherwise.
The token weights come from the real components: ``sampler_is`` with logp_old − logp_sampler = log w (so
its token ratio is w exactly, below the cap 3), ``top_entropy`` from the entropies.

    luspo, level "token" (per token, seq_mean_token_sum):  l_t = −ratio_t·A = −1;  loss = Σ_t w_t·l_t / 1 row
        w = (2, 0.5): loss −2.5, ∂/∂logp_t = −w_t·ratio_t·A = (−2, −0.5)        (TRL 1.16, the issue's numbers)
    luspo, level "sequence": l_t = −s·A with s = exp(mean_t d) = 1, ∂s/∂logp_t = s/2
        w = (2, 0.5): loss −2.5, ∂/∂logp_t = −A·(w_1 + w_2)·s/2 = −1.25 on both tokens
    luspo + top_entropy(ρ = 0.5), entropies (2, 1): keep token 0 (k = ceil(0.5·2) = 1) → w = (1, 0)
        token level: loss −1, gradient (−1, 0); sequence level: loss −1, gradient (−0.5, −0.5)
    gmpo (row:geo_mean): loss = −adv_s·ratio·(w_1·w_2)^(1/2)
        w = (2, 1): −√2 = −1.414214, ∂/∂logp_t = −√2·(1/2) = −0.707107        (verl geo_mean, the issue's numbers)
        w = (1, 0) (top_entropy, scope "loss"): factor 0 → loss 0, no gradient
        top_entropy scope "token": token 1 leaves the row: mean over token 0 only, factor 1 → −1, gradient (−1, 0)
    kl (exempt): k3 at logp_ref − logp = −0.5: e^−0.5 + 0.5 − 1 = 0.106531 per token, whatever the weights
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, leaf, objective_for, rollout_from

from groupwise.errors import ConfigError
from groupwise.objective import Objective, check_token_weights, geo_mean_factor, token_weight_mode, token_weights
from groupwise.registry import build

SQRT2 = math.sqrt(2.0)


def _row(w=(1.0, 1.0), entropy=None, adv=1.0):
    """One row, 2 tokens, on-policy: logp = logp_old = (−1, −2); sampler log-probs make the IS ratio ``w``."""
    logp_old = torch.tensor([[[-1.0, -2.0]]])  # [1,1,2]
    ro = rollout_from(logp_old, torch.tensor([[adv]]), logp_sampler=logp_old - torch.tensor(w).log())
    ro.logp_ref = logp_old - 0.5
    if entropy is not None:
        ro.set_extra("entropy", torch.tensor([[entropy]]), "token")
    return ro, leaf(logp_old)


def _weighted_loss(term, weights, ro, logp, agg="seq_mean_token_mean"):
    """The objective's loss and gradient for ``term`` with the weight components ``weights`` run on the batch."""
    info = info_for(ro.shape[2])
    if weights:
        ro.weight, counted = token_weights(weights, ro, info)  # [1,1,2] x2
        ro.set_extra("counted", counted, "token")
    obj = objective_for([term], agg)
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad.flatten().tolist()


IS = build("weight", "sampler_is", mode="token_truncate")  # cap 3: ratios 2 and 0.5 pass unchanged


# ---------------------------------------------------------------------------------------------- luspo (per token)
def test_luspo_token_level_with_is_ratios_is_trls():
    ro, logp = _row(w=(2.0, 0.5))
    loss, grad = _weighted_loss(build("objective", "luspo", level="token", eps_low=0.2, eps_high=0.2), [IS], ro, logp)
    assert loss == pytest.approx(-2.5) and grad == pytest.approx([-2.0, -0.5])  # before: −2.0, (−1, −1)


def test_luspo_sequence_level_with_is_ratios():
    ro, logp = _row(w=(2.0, 0.5))
    loss, grad = _weighted_loss(build("objective", "luspo", eps_low=0.2, eps_high=0.2), [IS], ro, logp)
    assert loss == pytest.approx(-2.5) and grad == pytest.approx([-1.25, -1.25])


@pytest.mark.parametrize("level,grad", [("token", [-1.0, 0.0]), ("sequence", [-0.5, -0.5])])
def test_luspo_with_top_entropy(level, grad):
    ro, logp = _row(entropy=[2.0, 1.0])
    top = build("weight", "top_entropy", rho=0.5)
    loss, got = _weighted_loss(build("objective", "luspo", level=level), [top], ro, logp)
    assert loss == pytest.approx(-1.0) and got == pytest.approx(grad)  # before: −2 (the mask ignored)


# ---------------------------------------------------------------------------------------------- gmpo (row geo mean)
def test_gmpo_weights_reach_the_row_as_their_geometric_mean():
    ro, logp = _row(w=(2.0, 1.0))
    loss, grad = _weighted_loss(build("objective", "gmpo"), [IS], ro, logp)
    assert loss == pytest.approx(-SQRT2, rel=1e-6)  # before: −1 (the weights ignored)
    assert grad == pytest.approx([-SQRT2 / 2, -SQRT2 / 2], rel=1e-6)


def test_gmpo_zero_weight_scope_loss_and_token():
    ro, logp = _row(entropy=[2.0, 1.0])
    loss, grad = _weighted_loss(build("objective", "gmpo"), [build("weight", "top_entropy", rho=0.5)], ro, logp)
    assert loss == 0.0 and grad == [0.0, 0.0]  # geometric mean of (1, 0) = 0 (verl: 1e-10^(1/2) = 1e-5)
    ro, logp = _row(entropy=[2.0, 1.0])
    top = build("weight", "top_entropy", rho=0.5, scope="token")
    loss, grad = _weighted_loss(build("objective", "gmpo"), [top], ro, logp)
    assert loss == pytest.approx(-1.0) and grad == pytest.approx([-1.0, 0.0])  # token 1 left the row's means


def test_geo_mean_factor_by_hand():
    w = torch.tensor([[[2.0, 8.0, 5.0], [0.5, 0.0, 3.0], [4.0, 4.0, 4.0]]])  # [1,3,3]
    mask = torch.tensor([[[1, 1, 0], [1, 1, 1], [0, 0, 0]]], dtype=torch.bool)
    # row 0: (2·8)^(1/2) = 4 (5 is off the mask); row 1: a zero → 0; row 2: no token → 1
    torch.testing.assert_close(geo_mean_factor(w, mask), torch.tensor([[4.0, 0.0, 1.0]]))


# ---------------------------------------------------------------------------------------------- exempt, none
def test_kl_is_exempt_from_weight_values():
    for w in ((1.0, 1.0), (2.0, 0.5)):
        ro, logp = _row(w=w)
        loss, _ = _weighted_loss(build("objective", "kl", coef=1.0), [IS], ro, logp)
        assert loss == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-6)  # 0.106531, unscaled by (2, 0.5)


@pytest.mark.parametrize("name", ["conspo", "dgpo", "disa", "graphdpo", "hard_pair", "holderpo", "lpo", "rspo"])
def test_terms_that_take_no_weight_refuse_one_naming_term_weight_and_reason(name):
    term = build("objective", name)
    assert token_weight_mode(term) == "none"
    for weight in ("sampler_is", "top_entropy", "mask_truncated"):
        with pytest.raises(ConfigError, match=rf"{name}.*{weight}.*{term.token_weights_reason[:20]}"):
            Objective.from_config([name, "ppo_clip"], "seq_mean_token_mean", [build("weight", weight)])
    Objective.from_config([name], "seq_mean_token_mean", [])  # without a weight it builds


def test_f_grpo_and_lope_declare_by_their_options():
    assert token_weight_mode(build("objective", "f_grpo")) == "none"  # sequence level: one ratio per phase
    assert token_weight_mode(build("objective", "f_grpo", level="token")) == "token"
    assert token_weight_mode(build("objective", "lope")) == "token"  # its base ppo_clip's
    assert token_weight_mode(build("objective", "lope", base="gmpo")) == "none"  # a per-row base, per-token shaping
    with pytest.raises(ConfigError, match="lope.*sampler_is.*gmpo"):
        check_token_weights([build("objective", "lope", base="gmpo")], [build("weight", "sampler_is")])


def test_weights_that_reach_no_term_are_refused():
    with pytest.raises(ConfigError, match="reach no objective term"):
        Objective.from_config(["kl", "entropy_bonus"], "token_mean", [build("weight", "top_entropy")])
    Objective.from_config(["ppo_clip", "kl"], "token_mean", [build("weight", "top_entropy")])


def test_a_row_term_declared_per_token_and_a_bad_declaration_are_errors():
    class RowTerm:  # returns [b,G] but declares nothing: "token" by default
        registry_name, coef, agg = "row_term", 1.0, None

        def __call__(self, mb, out, info):
            return out["logp"].sum(-1)  # [b,G]

    ro, logp = _row()
    obj = objective_for([RowTerm()], "seq_mean_token_mean")
    with pytest.raises(ValueError, match="row_term.*row values.*token_weights"):
        obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(2)), info_for(2))
    bad = RowTerm()
    bad.token_weights = "row:mean"
    with pytest.raises(ConfigError, match="row_term.*row:mean"):
        token_weight_mode(bad)


def test_the_trainer_refuses_a_term_that_cannot_take_the_weight(tmp_path):
    from test_trainer import make_trainer

    with pytest.raises(ConfigError, match="lpo.*sampler_is"):
        make_trainer(tmp_path, 'objective.terms=["lpo"]', 'objective.weights=["sampler_is"]')


def test_a_role_refuses_a_term_that_cannot_take_its_weight(tmp_path):
    from test_roles import codistill

    with pytest.raises(ConfigError, match="rspo.*sampler_is"):  # the codistill teacher's objective has sampler_is
        codistill(tmp_path, 'roles.teacher.objective.terms=["rspo"]')
