"""AGPO (specs/59), worked by hand. Correct rows get lam_pos·(1 − p)/sqrt(p(1 − p) + eps), wrong rows −lam_neg::

[1,0,0,0]  p = 1/4: .75/sqrt(.1875) = .75/.433013 = 1.732051    → [1.732051, −1, −1, −1]
[1,1,0,0]  p = 1/2: .5/sqrt(.25)    = .5/.5       = 1           → [1, 1, −1, −1]
[1,1,1,0]  p = 3/4: .25/sqrt(.1875) = .25/.433013 = 0.577350    → [.577350 ×3, −1]
[1,1,1,1]  p = 1:   0/sqrt(0 + 1e-8) = 0                         → zeros
[0,0,0,0]  p = 0:   no correct row                               → [−1]×4 (GRPO: zeros)
pos_scale = "variance": lam_pos·(1 − p) → .75, .5, .25
"""

from __future__ import annotations

import pytest
import torch
from helpers import info_for, objective_for, permute_rows, permute_tensor, random_perm, rollout_from, train_recorded

from groupwise.advantages.agpo import agpo_advantages
from groupwise.errors import ConfigError
from groupwise.registry import build

SPEC = [[1.0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
WANT = [[1.732051, -1, -1, -1], [1, 1, -1, -1], [0.577350, 0.577350, 0.577350, -1], [0, 0, 0, 0], [-1, -1, -1, -1]]


def _ro(rewards, valid=None):
    r = torch.tensor(rewards, dtype=torch.float32)  # [B,G]
    ro = rollout_from(torch.zeros(*r.shape, 2), rewards=r)
    if valid is not None:
        ro.group_valid = torch.tensor(valid, dtype=torch.bool)
    return ro


def _close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def test_spec_unit_test():
    est = build("advantage", "agpo")
    _close(est(_ro(SPEC), info_for(2)), WANT)
    assert est.step_stats()["agpo/all_fail_frac"] == pytest.approx(1 / 5)
    # positives: 1.732051 + 2·1 + 3·.577350 + 4·0 = 1.732051 + 2 + 1.732051 = 5.464102 over 10 correct rows
    assert est.step_stats()["agpo/pos_mean"] == pytest.approx(0.5464102, abs=1e-5)


def test_variance_scale_and_lambdas():
    _close(
        build("advantage", "agpo", pos_scale="variance")(_ro(SPEC[:3]), info_for(2)),
        [[0.75, -1, -1, -1], [0.5, 0.5, -1, -1], [0.25, 0.25, 0.25, -1]],
    )
    _close(
        build("advantage", "agpo", lam_pos=2.0, lam_neg=0.5)(_ro([[1, 0, 0, 0]]), info_for(2)),
        [[3.464102, -0.5, -0.5, -0.5]],
    )


def test_threshold_for_non_binary_rewards():
    # 0.7 and 0.5 count as correct (>= .5), 0.2 and 0.49 wrong: p = 1/2 → positives 1
    _close(build("advantage", "agpo")(_ro([[0.7, 0.5, 0.2, 0.49]]), info_for(2)), [[1, 1, -1, -1]])


def test_invalid_nan_and_single_row_groups():
    ro = _ro([[1, 0, float("nan"), 1], [1, 0, 0, 0], [0, 1, 1, 1]], valid=[[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]])
    adv = build("advantage", "agpo")(ro, info_for(2))
    # group 0: valid rows 0, 1 → p = 1/2 → [1, −1]; NaN and invalid rows exactly 0, not counted in p
    # group 1: one valid correct row → p = 1 → 0;  group 2: one valid wrong row → −1
    _close(adv, [[1, -1, 0, 0], [0, 0, 0, 0], [-1, 0, 0, 0]])
    assert adv[0, 2] == 0 and adv[0, 3] == 0 and torch.isfinite(adv).all()


def test_function_matches_component_and_permutation():
    r = torch.randint(0, 2, (4, 6), generator=torch.Generator().manual_seed(0)).double()
    valid = torch.ones(4, 6, dtype=torch.bool)
    ro = _ro(r.float().tolist())
    adv = build("advantage", "agpo")(ro, info_for(2))
    torch.testing.assert_close(adv, agpo_advantages(r, valid).float())
    perm = random_perm(4, 6)
    torch.testing.assert_close(
        build("advantage", "agpo")(permute_rows(ro, perm), info_for(2)), permute_tensor(adv, perm)
    )


def test_masked_tokens_get_zero_gradient():
    ro = _ro([[1, 0, 0, 0]])
    ro.mask = torch.tensor([[[True, False], [True, True], [False, False], [True, False]]])
    ro.advantages = build("advantage", "agpo")(ro, info_for(2))
    logp = torch.zeros(1, 4, 2, requires_grad=True)  # on-policy: logp_old is 0 too
    obj = objective_for([build("objective", "ppo_clip")], "token_mean")
    (grad,) = torch.autograd.grad(obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(2)), info_for(2)), logp)
    assert (grad[~ro.mask] == 0).all() and (grad[ro.mask] != 0).all()


def test_errors():
    with pytest.raises(ConfigError, match="pos_scale"):
        build("advantage", "agpo", pos_scale="rank")
    with pytest.raises(ConfigError, match="eps"):
        build("advantage", "agpo", eps=0.0)


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_on_the_embedded_model(tmp_path, objective):
    rows, seen = train_recorded(
        tmp_path, objective, 'advantage.estimator="agpo"', "rollout.group_size=8", "rollout.prompts_per_step=8"
    )
    for row, batch in zip(rows, seen):
        valid = batch.group_valid & torch.isfinite(batch.rewards)
        # AGPO's, not GRPO's
        torch.testing.assert_close(batch.advantages, agpo_advantages(batch.rewards.double(), valid).float())
        wrong = valid & (batch.rewards < 0.5)
        assert wrong.any() and (batch.advantages[wrong] == -1).all()  # every wrong row −1, all-fail groups included
        assert 0 <= row["agpo/all_fail_frac"] <= 1
