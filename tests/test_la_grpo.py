"""LA-GRPO (specs/18): the anchor term on functional-token positions and the usage-validity reward, by hand.

Spec unit test (one rollout, T = 10, A = +1, on-policy ratio 1, one functional token at t = 3)::

    per-token surrogate −1 everywhere;  L_GRPO = −1 (mean of 10)        ∂L_GRPO/∂logp_t = −1/10
    L_anchor = −1 (one functional token, normaliser 1)                  ∂L_anchor/∂logp_3 = −1
    L = L_GRPO + 0.5 · L_anchor = −1.5;  ∂L/∂logp_3 = −0.1 − 0.5 = −0.6 (6×), other tokens −0.1

Off-policy anchor (B=1, G=2, T=3; F = {"+", "-", "*"} = ids {2, 3, 4}; id 1 is ordinary)::

    row 0, A = +1, actions [+, a, *], logp − logp_old = [.5, 0, .1]
        t0: ratio e^.5 = 1.6487 > 1.2 → loss −1.2 (clipped, no gradient)
        t2: ratio e^.1 = 1.105171     → loss −1.105171, ∂/∂logp = −1.105171
    row 1, A = −1, actions [a, -, *], mask [1, 1, 0], logp − logp_old = [0, −.1, ·]
        t1: ratio e^−.1 = .904837 ≥ .8 → loss −min(−.904837, −.8) = .904837, ∂/∂logp = +.904837
        t2: "*" outside the mask: not functional, not counted
    N_f = 3:  L_anchor = (−1.2 − 1.105171 + .904837) / 3 = −.466778
              ∂L/∂logp = [0, 0, −.368390] (row 0), [0, .301612, 0] (row 1)

Log-prob anchor on the same rows, logp = [−.5, ·, −.9] (row 0), [·, −1.1, ·] (row 1)::

    −A·logp on f = [.5, .9] and [−1.1]:  L = .3 / 3 = .1;  ∂L/∂logp = −A/3 = [−1/3, ·, −1/3], [·, +1/3, ·]
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    assert_micro_batch_invariant,
    check_micro_batching,
    info_for,
    make_logp,
    make_rollout,
    objective_for,
    rollout_from,
    train_recorded,
)

from groupwise.errors import ConfigError
from groupwise.losses.la_grpo import functional_token_mask, resolve_tokens
from groupwise.registry import build

VOCAB = ["", "a", "+", "-", "*"]  # id 0 EOS, 1 ordinary, 2-4 the functional operators


def _anchor(**params):
    term = build("objective", "la_grpo", **params)
    term.use_vocabulary(VOCAB)
    return term


def _loss_grad(terms, ro, logp, agg="seq_mean_token_mean"):
    obj = objective_for(terms, agg)
    info = info_for(ro.shape[2])
    logp = logp.detach().clone().requires_grad_(True)
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _spec_rollout(func_at=(3,)):
    actions = torch.ones(1, 1, 10, dtype=torch.long)  # [1,1,10] ordinary tokens
    for t in func_at:
        actions[0, 0, t] = 2  # "+"
    logp_old = torch.full((1, 1, 10), -0.7)  # [1,1,10]
    return rollout_from(logp_old, torch.tensor([[1.0]]), actions=actions), logp_old.clone()


# ---------------------------------------------------------------------------------------------- spec numbers
@pytest.mark.parametrize("main", ["ppo_clip", "gspo"])
def test_spec_unit_test_six_times_the_gradient_on_the_functional_token(main):
    ro, logp = _spec_rollout()
    loss, grad = _loss_grad([build("objective", main), _anchor()], ro, logp)
    _close(loss, -1.5)
    want = torch.full((1, 1, 10), -0.1)
    want[0, 0, 3] = -0.6  # −A/T − λ·A/N_f = −0.1 − 0.5
    _close(grad, want)
    base_loss, base_grad = _loss_grad([build("objective", main)], ro, logp)
    _close(base_loss, -1.0)
    _close(base_grad, torch.full((1, 1, 10), -0.1))  # without the anchor: −0.1 on the functional token too


def test_spec_anchor_alone():
    ro, logp = _spec_rollout()
    loss, grad = _loss_grad([_anchor(coef=1.0)], ro, logp)
    _close(loss, -1.0)  # L_anchor = −1
    want = torch.zeros(1, 1, 10)
    want[0, 0, 3] = -1.0
    _close(grad, want)
    assert (grad[0, 0, [0, 1, 2, 4, 5, 6, 7, 8, 9]] == 0).all()  # exactly 0 off the functional position


def _off_policy():
    actions = torch.tensor([[[2, 1, 4], [1, 3, 4]]])  # [1,2,3]
    mask = torch.tensor([[[True, True, True], [True, True, False]]])
    logp_old = torch.full((1, 2, 3), -1.0)  # [1,2,3]
    logp = logp_old + torch.tensor([[[0.5, 0.0, 0.1], [0.0, -0.1, 0.0]]])  # [1,2,3]
    return rollout_from(logp_old, torch.tensor([[1.0, -1.0]]), mask=mask, actions=actions), logp


def test_off_policy_anchor_clip_and_functional_count():
    ro, logp = _off_policy()
    term = _anchor(coef=1.0)
    values = term(ro, {"logp": logp}, info_for(3))  # [1,2,3]
    _close(values, [[[-1.2, 0.0, -math.exp(0.1)], [0.0, math.exp(-0.1), 0.0]]])
    loss, grad = _loss_grad([term], ro, logp, agg="token_mean")
    _close(loss, (-1.2 - math.exp(0.1) + math.exp(-0.1)) / 3)  # −.466778
    _close(grad, [[[0.0, 0.0, -math.exp(0.1) / 3], [0.0, math.exp(-0.1) / 3, 0.0]]])
    stats = term.stats(ro, {"logp": logp})
    _close(stats["la_grpo/func_frac"], [[[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]])  # t2 of row 1 is masked
    _close(stats["la_grpo/func_rows"], [[1.0, 1.0]])


def test_logprob_anchor():
    ro, _ = _off_policy()
    logp = torch.tensor([[[-0.5, -1.0, -0.9], [-1.0, -1.1, 55.0]]])  # garbage past the mask
    loss, grad = _loss_grad([_anchor(coef=1.0, anchor="logprob")], ro, logp, agg="token_mean")
    _close(loss, 0.1)  # (.5 + .9 − 1.1) / 3
    _close(grad, [[[-1 / 3, 0.0, -1 / 3], [0.0, 1 / 3, 0.0]]])


def test_seq_mean_aggregation_over_the_functional_tokens():
    # agg = seq_mean_token_mean: row 0's functional mean (−1.2 − 1.105171)/2, row 1's .904837, mean over the 2 rows
    ro, logp = _off_policy()
    loss, _ = _loss_grad([_anchor(coef=1.0, agg="seq_mean_token_mean")], ro, logp, agg="token_mean")
    _close(loss, ((-1.2 - math.exp(0.1)) / 2 + math.exp(-0.1)) / 2)


def test_the_main_term_keeps_its_own_normaliser():
    # same aggregation for both terms: ppo_clip still averages over all 5 loss tokens, the anchor over its 3
    ro, logp = _off_policy()
    both, grad_both = _loss_grad([build("objective", "ppo_clip"), _anchor(coef=0.5)], ro, logp, agg="token_mean")
    main, grad_main = _loss_grad([build("objective", "ppo_clip")], ro, logp, agg="token_mean")
    anchor, grad_anchor = _loss_grad([_anchor(coef=1.0)], ro, logp, agg="token_mean")
    _close(both, main + 0.5 * anchor)
    _close(grad_both, grad_main + 0.5 * grad_anchor)
    _close(grad_main[0, 0, 1], -1.0 / 5)  # ordinary token, A = +1, ratio 1, 5 loss tokens


# ---------------------------------------------------------------------------------------------- edge cases
def test_no_functional_token_in_the_batch_is_exactly_zero():
    ro, logp = _spec_rollout(func_at=())
    loss, grad = _loss_grad([_anchor()], ro, logp)
    assert torch.equal(loss, torch.zeros(())) and torch.equal(grad, torch.zeros_like(grad))
    both, grad_both = _loss_grad([build("objective", "ppo_clip"), _anchor()], ro, logp)
    main, grad_main = _loss_grad([build("objective", "ppo_clip")], ro, logp)
    assert torch.equal(both, main) and torch.equal(grad_both, grad_main)


def test_functional_tokens_only_in_masked_or_invalid_rows_count_nothing():
    ro, logp = _spec_rollout(func_at=(3,))
    ro.group_valid = torch.tensor([[False]])
    loss, grad = _loss_grad([_anchor()], ro, logp)
    assert torch.equal(loss, torch.zeros(())) and torch.equal(grad, torch.zeros_like(grad))


def test_constant_group_and_garbage_are_finite():
    ro = make_rollout(3, 4, 5, seed=2)
    ro.advantages = torch.zeros(3, 4)
    term = build("objective", "la_grpo", tokens=["+"])
    term.use_vocabulary(["+" if i % 3 == 0 else "x" for i in range(50)])
    loss, grad = _loss_grad([term], ro, make_logp(ro))
    assert torch.equal(loss, torch.zeros(())) and torch.isfinite(grad).all() and (grad == 0).all()


def test_functional_token_mask_interface():
    ids = torch.tensor([[1, 2, 3, 4, 2]])  # [N,T]
    mask = torch.tensor([[True, True, True, True, False]])
    f = functional_token_mask(ids, torch.tensor([2, 4]), mask)
    assert f.tolist() == [[False, True, False, True, False]]


# ------------------------------------------------------------------------------------------- micro-batch and world size
def _random_case(seed=4):
    ro = make_rollout(6, 4, 6, seed=seed)
    vocab = ["+" if i % 5 == 0 else "x" for i in range(50)]  # every fifth id functional
    return ro, vocab


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("anchor", ["surrogate", "logprob"])
def test_micro_batch_invariant(agg, anchor):
    ro, vocab = _random_case()
    term = build("objective", "la_grpo", anchor=anchor, agg=agg, tokens=["+"])
    term.use_vocabulary(vocab)
    assert_micro_batch_invariant(term, agg, ro, make_logp(ro))


def test_micro_batch_invariant_with_a_main_term():
    ro, vocab = _random_case(seed=6)
    term = build("objective", "la_grpo", tokens=["+"])
    term.use_vocabulary(vocab)
    obj = objective_for([build("objective", "ppo_clip"), term], "seq_mean_token_mean")
    check_micro_batching(obj, ro, [[0, 4], [1], [2, 3, 5]], info_for(6))


def test_guard_per_micro_batch_count_would_differ():
    """The invariance test can fail: normalising each micro-batch by its own functional count does not add up."""
    ro, vocab = _random_case()
    term = build("objective", "la_grpo", tokens=["+"])
    term.use_vocabulary(vocab)
    obj, info, logp = objective_for([term], "token_mean"), info_for(6), make_logp(ro)
    whole = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    split = [[0, 4], [1], [2, 3, 5]]
    local = sum(
        obj.loss(ro.select(idx), {"logp": logp[idx]}, obj.normalizers(ro.select(idx), info), info) for idx in split
    )
    assert not torch.allclose(whole, local, atol=1e-4)


# -------------------------------------------------------------------------------------------- vocabulary and validation
def _tiny_token_texts():
    from transformers import AutoTokenizer

    from groupwise.policy.lm import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    special = set(tok.all_special_ids)
    return ["" if i in special else tok.decode([i]) for i in range(len(tok))]


def test_tokens_resolve_through_the_embedded_vocabulary():
    texts = _tiny_token_texts()
    ids = resolve_tokens(["+", "-", "*"], texts, "t")
    assert sorted(texts[i] for i in ids) == ["*", "+", "-"]
    with pytest.raises(ConfigError, match=r"'<op1>' is not one token"):
        resolve_tokens(["+", "<op1>"], texts, "objective la_grpo")


def test_every_id_with_the_text_is_functional():
    assert resolve_tokens(["+"], ["", "+", "a", "+"], "t") == [1, 3]


def test_unbound_vocabulary_is_a_clear_error():
    ro, logp = _spec_rollout()
    with pytest.raises(ValueError, match="no vocabulary"):
        build("objective", "la_grpo")(ro, {"logp": logp}, info_for(10))


@pytest.mark.parametrize(
    "params, match",
    [
        ({"anchor": "kl"}, "anchor must be one of"),
        ({"tokens": []}, "non-empty list"),
        ({"tokens": ["+", ""]}, "non-empty list"),
        ({"tokens": "+"}, "tokens"),
        ({"tokens": ["+", "+"]}, "twice"),
        ({"eps_low": 1.5}, "eps_low"),
    ],
)
def test_validation(params, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        build("objective", "la_grpo", **params)


def test_a_multi_token_functional_text_fails_the_build(tmp_path):
    from test_trainer import make_trainer

    with pytest.raises(ConfigError, match="'<op1>'"):
        make_trainer(tmp_path, 'objective.terms=["ppo_clip", {name="la_grpo", tokens=["<op1>"]}]')


# ---------------------------------------------------------------------------------------------- reward
def _usage(completions, **params):
    cols = params.pop("columns", {})
    return build("reward", "functional_usage", **params)([""] * len(completions), completions, **cols)


def test_usage_reward_counts():
    texts = ["13*7=91", "13+7", "137=91", "1+2*3", ""]
    assert _usage(texts) == [1.0, 1.0, 0.0, 1.0, 0.0]  # min_count 1
    assert _usage(texts, max_count=1) == [1.0, 1.0, 0.0, 0.0, 0.0]  # exactly one
    assert _usage(texts, min_count=0, max_count=1) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_usage_reward_row_column():
    texts = ["13*7=91", "13+7=20", "13-7=6", "1+2*3"]
    cols = {"op": ["*", "*", None, ["+", "*"]]}
    assert _usage(texts, column="op", columns=cols) == [1.0, 0.0, None, 1.0]


def test_usage_reward_longest_text_first():
    assert _usage(["a<<b"], tokens=["<", "<<"], max_count=1) == [1.0]  # "<<" once, not "<" twice


@pytest.mark.parametrize(
    "params", [{"tokens": []}, {"min_count": -1}, {"max_count": 0}, {"min_count": 2, "max_count": 1}]
)
def test_usage_reward_validation(params):
    with pytest.raises(ConfigError):
        build("reward", "functional_usage", **params)


def test_op_select_task():
    from groupwise.tasks import get_task

    task = get_task("op_select")
    train, test = task.rows("train", 0, 0), task.rows("test", 0, 0)
    assert len(test) == 200 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train + test:
        a, b = r["nums"]
        assert r["answer"] == f"{a}{r['op']}{b}={r['target']}" and r["prompt"] == f"{a}?{b}={r['target']}:"
        assert sum(eval(f"{a}{op}{b}") == r["target"] for op in "+-*") == 1  # one true operator (no (2, 2))


# ---------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("main", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("estimator", ["grpo", "sign"])
def test_two_steps_on_the_embedded_model(tmp_path, main, estimator):
    # "1" as the functional token: frequent in the addition task's answers
    terms = f'objective.terms=["{main}", {{name="la_grpo", tokens=["1"]}}, {{name="kl", coef=0.04}}]'
    rows, seen = train_recorded(
        tmp_path,
        main,
        terms,
        f'advantage.estimator="{estimator}"',
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
    )
    texts = _tiny_token_texts()
    one = torch.tensor([i for i, t in enumerate(texts) if t == "1"])
    for row, batch in zip(rows, seen):
        mask = batch.row_mask
        f = torch.isin(batch.actions, one) & mask  # [B,G,T]
        assert f.any()
        _close(torch.tensor(row["la_grpo/func_frac"]), f.sum() / mask.sum(), atol=1e-6)
        _close(torch.tensor(row["la_grpo/func_rows"]), f.any(-1).sum() / mask.any(-1).sum(), atol=1e-6)


@pytest.mark.parametrize("extra", [[], ["train.epochs=2", "train.minibatches=2"]])
def test_trainer_gradient_does_not_depend_on_micro_batching(tmp_path, extra):
    # the trainer's own check (loss, gradient and weights with micro_batch_groups 0 vs 1) with the anchor in the
    # objective; "1" is functional and frequent in the addition answers (test_two_steps_on_the_embedded_model)
    from test_trainer import test_loss_and_gradient_do_not_depend_on_micro_batching as check

    check(tmp_path, ['objective.terms=["ppo_clip", {name="la_grpo", tokens=["1"]}]', *extra])
