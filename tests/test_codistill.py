"""CoDistill-GRPO KD reward, truncated IS weights and teacher loss (spec 44), worked by hand.

Shapes [N,T]; NaN sits on every padding position so that a leak shows in values or gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from groupwise.losses.codistill import (
    codistill_student_rewards,
    codistill_teacher_loss,
    kd_reward,
    teacher_is_stats,
    truncated_is_weights,
)

NAN = float("nan")
EM01, E04 = math.exp(-0.1), math.exp(0.4)  # 0.904837, 1.491825


def test_kd_reward_spec_numbers_and_masking():
    student = torch.tensor([[-1.0, -2.0], [-1.0, NAN], [NAN, NAN]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -1.0], [-0.5, NAN], [NAN, NAN]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    r = kd_reward(student, teacher, mask)
    # row 0: mean(0.5, 1.0) = 0.75 (spec); row 1: only token 0 → 0.5; row 2: no tokens → 0, not NaN
    torch.testing.assert_close(r, torch.tensor([0.75, 0.5, 0.0]))
    assert r.dtype == torch.float32 and not r.requires_grad  # a reward: no gradient to the student


def test_student_rewards_add_the_kd_term():
    r = codistill_student_rewards(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.75, -0.5]]), lam=0.5)
    torch.testing.assert_close(r, torch.tensor([[1.375, -0.25]]))  # 1 + 0.5·0.75, 0 − 0.5·0.5


def test_truncated_is_weights_spec_numbers():
    old = torch.tensor([[-1.0, -1.0, NAN]])
    student = torch.tensor([[-2.0, -0.9, NAN]])
    mask = torch.tensor([[1, 1, 0]])
    # token 0: raw e^1 = 2.718282 → truncated at C=2 → 2.0 (spec); token 1: e^−0.1 below C, kept; pad → 0
    w = truncated_is_weights(old, student, 2.0, mask=mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, EM01, 0.0]]))
    torch.testing.assert_close(truncated_is_weights(old, student, 3.0, mask=mask), torch.tensor([[math.e, EM01, 0.0]]))
    stats = teacher_is_stats(old, student, mask)
    assert stats["is_weight_mean"] == pytest.approx((2.0 + EM01) / 2) and stats["is_truncated_frac"] == 0.5


def _case():
    # row 0, A=+1: token 0 ρ=1, w=min(2, e)=2; token 1 ρ=e^0.5 (clipped at 1.2), w=e^−0.1; token 2 padding
    # row 1, A=−1: token 0 ρ=e^−0.1 (inside the clip), w=1; tokens 1, 2 padding
    old_L = torch.tensor([[-1.0, -1.0, NAN], [-0.5, NAN, NAN]])
    logp_L = (old_L + torch.tensor([[0.0, 0.5, 0.0], [-0.1, 0.0, 0.0]])).requires_grad_()
    student = torch.tensor([[-2.0, -0.9, NAN], [-0.5, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logp_L, old_L, student, torch.tensor([1.0, -1.0]), mask


def test_teacher_loss_by_hand():
    logp_L, old_L, student, adv, mask = _case()
    loss = codistill_teacher_loss(logp_L, old_L, student, adv, mask)
    # per-token: −2·1·1 = −2.0 (spec); −e^−0.1·1.2 = −1.085805; +1·e^−0.1 = +0.904837; / Σmask = 3
    expected = (-2.0 - EM01 * 1.2 + EM01) / 3  # −0.726989
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp_L)
    # d/dlogp = −w·ρ·A/3 where unclipped; 0 on the clipped token and on padding (no NaN leak)
    torch.testing.assert_close(grad, torch.tensor([[-2.0 / 3, 0.0, 0.0], [EM01 / 3, 0.0, 0.0]]))


def test_teacher_loss_token_advantages_equal_sequence_ones():
    logp_L, old_L, student, adv, mask = _case()
    a = codistill_teacher_loss(logp_L, old_L, student, adv, mask)
    b = codistill_teacher_loss(logp_L, old_L, student, adv[:, None].expand(2, 3).clone(), mask)
    torch.testing.assert_close(a, b)


def test_no_gradient_through_the_weights():
    logp_L, old_L, student, adv, mask = _case()
    old_L = old_L.clone().requires_grad_()
    student = student.clone().requires_grad_()
    codistill_teacher_loss(logp_L, old_L, student, adv, mask).backward()
    # token 1 of row 0 has an untruncated weight e^−0.1: an undetached weight would send gradient here
    assert student.grad is None and old_L.grad is None
    assert logp_L.grad is not None and torch.isfinite(logp_L.grad).all()


def test_sequence_level_weights():
    old = torch.tensor([[-1.0, -1.5, 5.0]])
    student = torch.tensor([[-1.2, -2.1, -5.0]])  # the padded token's log-ratio +10 must not enter the mean
    mask = torch.tensor([[1, 1, 0]])
    # token level: e^0.2 = 1.221403, e^0.6 = 1.822119; sequence: geometric mean e^((0.2+0.6)/2) = e^0.4
    torch.testing.assert_close(
        truncated_is_weights(old, student, mask=mask), torch.tensor([[math.exp(0.2), math.exp(0.6), 0.0]])
    )
    torch.testing.assert_close(
        truncated_is_weights(old, student, mask=mask, level="seq"), torch.tensor([[E04, E04, 0.0]])
    )
    torch.testing.assert_close(
        truncated_is_weights(old, student, 1.4, mask=mask, level="seq"), torch.tensor([[1.4, 1.4, 0.0]])
    )
    # teacher loss with ρ = 1, A = +1: −(e^0.4 + e^0.4) / 2 = −1.491825
    loss = codistill_teacher_loss(old.clone().requires_grad_(), old, student, torch.tensor([1.0]), mask, is_level="seq")
    assert loss.item() == pytest.approx(-E04, rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"is_level": "row"}, "level must be one of"),
        ({"C": 0.0}, "C must be > 0"),
        ({"eps": 1.5}, "eps_low"),
        ({"adv": torch.ones(3)}, "adv must be"),
    ],
)
def test_bad_options_name_the_problem(kwargs, match):
    logp_L, old_L, student, adv, mask = _case()
    args = {"logp_L": logp_L, "old_logp_L": old_L, "student_logp": student, "adv": adv, "mask": mask} | kwargs
    with pytest.raises(ValueError, match=match):
        codistill_teacher_loss(**args)
