"""EDAS (specs/08), worked by hand.

Spec group: rewards [1,1,0,0,0,0], GRPO with the unbiased std and eps 1e-6::

    mean = 1/3;  std = sqrt((2·(2/3)² + 4·(1/3)²) / 5) = sqrt(1.333333/5) = 0.516398
    A = [ (2/3)/0.516398 ] ×2 = 1.290992,   [ −(1/3)/0.516398 ] ×4 = −0.645496

Branch C, wrong answers ['3','3','3','7']: N_w = 4, S = mean|A_W| = 0.645496
    H = −(.75 ln .75 + .25 ln .25) = .215762 + .346574 = 0.562335;  ln 4 = 1.386294
    '3': p = .75, I = .287682, C = (.287682 − .562335)/1.386294 = −0.198120
         Δ = .4 · .645496 · (−.198120) = −0.051154  → A = −0.696650
    '7': p = .25, I = 1.386294, C = (1.386294 − .562335)/1.386294 = +0.594361
         Δ = .4 · .645496 · .594361 = +0.153463 < cap .645496/2 = .322748 → A = −0.492033
    ΣΔ = 3·(−0.051154) + 0.153463 = 0
Branch B, all '3' (β = 0.2): Δ = −.2 · .645496 = −0.129099 → A_wrong = −0.774595.

κ-clip: W advantages [−0.1, −1.9, −1.9], answers ['r','c','c'] (α = 0.4, κ = 2)::

    S = (0.1 + 1.9 + 1.9)/3 = 1.3;  H = −(⅓ ln ⅓ + ⅔ ln ⅔) = .366204 + .270310 = 0.636514;  ln 3 = 1.098612
    'r': C = (1.098612 − .636514)/1.098612 = .420620, Δ = .4·1.3·.420620 = +0.218722 > cap .1/2 → A = −0.05
    'c': C = (.405465 − .636514)/1.098612 = −.210310, Δ = −0.109361 (cap .95) → A = −2.009361
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    info_for,
    make_rollout,
    objective_for,
    permute_rows,
    permute_tensor,
    random_perm,
    rollout_from,
    train_recorded,
)

from groupwise.advantages.edas import answer_classes, edas_shape
from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rewards.exact import Exact
from groupwise.rewards.math import final_answer

A_POS, A_NEG = 1.290992, -0.645496


def _ro(rewards, answers, adv=None, valid=None, column="final_answer"):
    """A rollout [B,G,2] with ``rewards`` [B][G], GRPO (unbiased, eps 1e-6) advantages unless given,
    and each row's answer in ``info[b][g]["extra"][column]`` (None: not logged)."""
    r = torch.tensor(rewards, dtype=torch.float32)  # [B,G]
    B, G = r.shape
    ro = rollout_from(
        torch.zeros(B, G, 2),
        rewards=r,
        completions=[[str(a) for a in row] for row in answers],
        info=[[{} if a is None else {"extra": {column: a}} for a in row] for row in answers],
    )
    if valid is not None:
        ro.group_valid = torch.tensor(valid, dtype=torch.bool)
    ro.advantages = (
        build("advantage", "grpo", eps=1e-6)(ro, info_for(2)) if adv is None else torch.tensor(adv, dtype=torch.float32)
    )
    return ro


def _edas(**kw):
    return build("advantage", "edas", answers="info:final_answer", **kw)


def _close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_branch_c_diverse_wrong_answers():
    ro = _ro([[1, 1, 0, 0, 0, 0]], [["82", "82", "3", "3", "3", "7"]])
    _close(ro.advantages, [[A_POS, A_POS, A_NEG, A_NEG, A_NEG, A_NEG]])
    shaper = _edas()
    adv = shaper(ro, info_for(2))
    _close(adv, [[A_POS, A_POS, -0.696650, -0.696650, -0.696650, -0.492033]])
    delta = adv.double() - ro.advantages.double()  # [1,6]
    assert float(delta.sum()) == pytest.approx(0.0, abs=1e-6)  # 3·(−.051154) + .153463 = 0
    stats = shaper.step_stats()
    assert stats["edas/groups_c"] == 1.0 and stats["edas/groups_b"] == 0.0
    assert (
        stats["edas/unique_wrong"] == 2.0
        and stats["edas/unique_wrong_frac"] == 0.5
        and stats["edas/clipped_frac"] == 0.0
    )


def test_spec_branch_b_error_perseveration():
    ro = _ro([[1, 1, 0, 0, 0, 0]], [["82", "82", "3", "3", "3", "3"]])
    shaper = _edas()
    _close(shaper(ro, info_for(2)), [[A_POS, A_POS] + [-0.774595] * 4])  # −.645496 − .2·.645496
    assert shaper.step_stats()["edas/groups_b"] == 1.0 and shaper.step_stats()["edas/unique_wrong"] == 1.0


def test_kappa_clip_keeps_the_sign():
    adv, stats = edas_shape(
        torch.tensor([[-0.1, -1.9, -1.9, 1.0]]), torch.tensor([[True, True, True, False]]), [["r", "c", "c", "x"]]
    )
    _close(adv, [[-0.05, -2.009361, -2.009361, 1.0]])  # Δ_r = +.218722 clipped to |−.1|/2
    assert stats["edas/clipped_frac"] == pytest.approx(1 / 3)
    adv, _ = edas_shape(
        torch.tensor([[-0.1, -1.9, -1.9]]),
        torch.ones(1, 3, dtype=torch.bool),
        [["r", "c", "c"]],
        alpha=100.0,
        kappa=1.5,
    )
    assert (adv < 0).all() and float(adv[0, 0]) == pytest.approx(-0.1 + 0.1 / 1.5)  # huge Δ: still −|A|(1 − 1/κ)


def test_one_wrong_row_and_all_wrong_group_unchanged():
    ro = _ro([[1, 1, 1, 0], [0, 0, 0, 0]], [["5", "5", "5", "4"], ["1", "1", "1", "1"]])
    adv = _edas()(ro, info_for(2))
    torch.testing.assert_close(adv, ro.advantages)  # N_w = 1 (branch A); all wrong: GRPO's A = 0 ⇒ S = 0 ⇒ Δ = 0
    assert (adv[1] == 0).all()


def test_alpha_beta_zero_is_the_identity_and_still_measures():
    ro = _ro([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], [["9", "3", "3", "4", "5"], ["7", "7", "1", "1", "1"]])
    shaper = _edas(alpha=0.0, beta=0.0)
    assert torch.equal(shaper(ro, info_for(2)), ro.advantages)
    assert shaper.step_stats()["edas/unique_wrong"] == pytest.approx((3 + 1) / 2)  # classes {3,4,5} and {1}


# ---------------------------------------------------------------------------------------------- edge cases
def test_invalid_rows_nan_rewards_and_constant_groups():
    ro = _ro(
        [[1, 0, 0, float("nan"), 0], [1, 1, 1, 1, 1]],
        [["2", "3", "3", "3", "4"], ["2"] * 5],
        adv=[[1.0, -0.5, -0.5, 9.0, -0.5], [0.0] * 5],
        valid=[[1, 1, 1, 1, 0], [1] * 5],
    )
    adv = _edas()(ro, info_for(2))
    assert adv[0, 3] == 0 and adv[0, 4] == 0  # NaN reward, group_valid False: exactly 0, and outside W
    # W = rows 1, 2 (both '3'): branch B, S = .5, Δ = −.2·.5 = −.1
    _close(adv[0, :3], [1.0, -0.6, -0.6])
    assert (adv[1] == 0).all()  # all correct: untouched
    assert torch.isfinite(adv).all()


def test_masked_tokens_get_zero_gradient():
    ro = _ro([[1, 0, 0, 0]], [["5", "3", "3", "4"]])
    ro.mask = torch.tensor([[[True, False], [True, True], [False, False], [True, False]]])
    ro.advantages = _edas()(ro, info_for(2))
    logp = torch.zeros(1, 4, 2, requires_grad=True)  # on-policy: logp_old is 0 too, ratio 1
    obj = objective_for([build("objective", "ppo_clip")], "token_mean")
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(2)), info_for(2))
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad[~ro.mask] == 0).all() and (grad[ro.mask] != 0).all()


def test_row_permutation_with_repeated_answers():
    ro = make_rollout(3, 6, 4, seed=9, binary=True)
    ro.info = [[{"extra": {"final_answer": str((b + g) % 3)}} for g in range(6)] for b in range(3)]
    ro.rewards = torch.tensor([[1.0, 0, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 1, float("nan")]])
    ro.advantages = build("advantage", "grpo")(ro, info_for(4))
    perm = random_perm(3, 6)
    shaper = _edas()
    adv = shaper(ro, info_for(4))
    assert not torch.equal(adv, ro.advantages)  # it shaped something
    torch.testing.assert_close(
        shaper(permute_rows(ro, perm), info_for(4)), permute_tensor(adv, perm), atol=1e-6, rtol=1e-6
    )


# ---------------------------------------------------------------------------------------------- options
def test_answers_from_completions_are_normalised():
    ro = _ro([[1, 0, 0, 0, 0, 0]], [["x", " Ab", "ab ", "AB", "ab", "c"]])
    ro.completions = [["x", " Ab", "ab ", "AB", "ab", "c"]]
    shaper = build("advantage", "edas")  # answers = "completion"
    shaper(ro, info_for(2))
    assert shaper.step_stats()["edas/unique_wrong"] == 2.0  # {ab} ×4, {c}
    assert answer_classes(["b", "a", "b", "c"]) == [1, 0, 1, 2]  # sorted distinct strings: order-free


def test_math_equivalence_merges_answers():
    shaper = _edas(equiv="math")
    try:
        ro = _ro([[1, 0, 0, 0]], [["2", "0.5", "1/2", "3"]])
        shaper(ro, info_for(2))
        assert shaper.step_stats()["edas/unique_wrong"] == 2.0  # 0.5 ≡ 1/2, 3
    finally:
        if shaper._pool is not None:
            shaper._pool.close()


def test_correct_and_format_parts():
    ro = _ro([[1, 0, 0, 0, 0]], [["4", "3", "3", "5", "3"]], adv=[[1.0, -0.5, -0.5, -0.5, -0.5]])
    ro.reward_parts = torch.tensor([[[1.0, 1], [0, 1], [0, 1], [0, 0], [0, float("nan")]]])  # [B,G,K]: exact, format
    plain = _edas(correct_part=0)(ro, info_for(2))
    fmt = _edas(correct_part=0, format_part=1)(ro, info_for(2))
    # plain: W = rows 1..4, classes {3}×3, {5}; with the format flag row 3 ('5', format 0) leaves W:
    # W = rows 1, 2, 4 all '3' (NaN flag kept) → branch B, Δ = −.2·.5 = −.1
    assert not torch.equal(plain, fmt)
    _close(fmt, [[1.0, -0.6, -0.6, -0.5, -0.6]])
    with pytest.raises(ConfigError, match="correct_part=5"):
        _edas(correct_part=5)(ro, info_for(2))


def test_config_and_input_errors():
    with pytest.raises(ConfigError, match="kappa"):
        build("advantage", "edas", kappa=1.0)
    with pytest.raises(ConfigError, match="info:COLUMN"):
        build("advantage", "edas", answers="final_answer")
    with pytest.raises(ConfigError, match="equiv"):
        build("advantage", "edas", equiv="fuzzy")
    ro = _ro([[1, 0, 0]], [[None, None, None]])
    with pytest.raises(ValueError, match="log_answer=true"):
        _edas()(ro, info_for(2))
    ro = _ro([[1, 0, 0]], [["1", "2", "2"]])
    ro.advantages = torch.zeros(1, 3, 2)
    with pytest.raises(ValueError, match=r"\[B,G\]"):
        _edas()(ro, info_for(2))


def test_rewards_log_the_final_answer():
    logged = {}
    exact = Exact(log_answer=True, stop="\n")
    assert exact.accepts_kwarg("log_extra") and not Exact().accepts_kwarg("log_extra")
    scores = exact(
        ["p"] * 3, [" 82\nmore", "8", "x"], log_extra=lambda c, v: logged.update({c: v}), answer=["82", "82", None]
    )
    assert scores == [1.0, 0.0, None] and logged == {"final_answer": ["82", "8", "x"]}
    assert (
        final_answer("so \\boxed{7} and \\boxed{ 12 }") == "12"
        and final_answer("x #### 1,450") == "1450"
        and final_answer(" 3 ") == "3"
    )


# ---------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_on_the_embedded_model(tmp_path, objective):
    rows, seen = train_recorded(
        tmp_path,
        objective,
        'rewards=[{name="exact", log_answer=true}]',
        'advantage.estimator={name="grpo", eps=1e-6}',
        'advantage.shapers=[{name="edas", answers="info:final_answer"}]',
        "rollout.group_size=8",
        "rollout.prompts_per_step=8",
    )
    changed = 0
    for row, batch in zip(rows, seen):
        B, G, _ = batch.shape
        answers = [[batch.info[b][g]["extra"]["final_answer"] for g in range(G)] for b in range(B)]
        # the reward's per-row info reached the shaper
        assert answers == [[c.strip() for c in group] for group in batch.completions]
        grpo = build("advantage", "grpo", eps=1e-6)(batch, info_for(6))  # [B,G] what the estimator gave
        valid = batch.group_valid & torch.isfinite(batch.rewards)
        want, stats = edas_shape(grpo, valid & (batch.rewards < 0.5), answers, valid=valid)
        torch.testing.assert_close(batch.advantages, want.float())  # the trainer's advantages are EDAS's
        assert (
            row["edas/unique_wrong"] == pytest.approx(stats["edas/unique_wrong"])
            and row["edas/groups_b"] + row["edas/groups_c"] > 0
        )
        changed += int((batch.advantages != grpo).sum())
    assert changed > 0  # the shaper really moved some wrong rows' advantages
