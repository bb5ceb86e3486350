"""SSOPD (specs/07) and the sibling_hint view, worked by hand.

Spec numbers::

    lengths [5,3,7,4], correct [1,1,0,0] → y⁺ = row 1 (len 3), y⁻ = row 2 (len 7), p̂ = ½, w = 4·½·½ = 1
    two-token vocabulary, teacher q = [.9, .1], student p = [.5, .5] at one position:
      KL(q‖p) = .9 ln 1.8 + .1 ln .2 = .529008 − .160944 = .368064
      ∂KL/∂student logits = p − q = [−.4, +.4]
    reverse KL(p‖q) = .5 ln(.5/.9) + .5 ln(.5/.1) = −.293893 + .804719 = .510826
    JSD: m = [.7, .3]; ½ KL(q‖m) + ½ KL(p‖m) = ½(.116322) + ½(.087177) = .101749
    tau = 2: q ∝ [√.9, √.1] = [.75, .25] (√.9/√.1 = 3); KL = .75 ln 1.5 + .25 ln .5 = .130812

Through the term (B=2 groups of G=4 rows, T=3, V=2; group 0 rewards [1,0,1,0] with lengths
[2,3,1,3] → y⁺ = row 2, y⁻ = row 1 (3 tokens, tie with row 3 → first), p̂ = ½, w = 1; group 1 all
correct → 0). Student uniform on every token; teacher q = [.9,.1] at y⁻'s token 0, uniform after::

    L_0 = 1 · (.368064 + 0 + 0) / 3 = .122688;  L_1 = 0;  group_mean = (.122688 + 0) / 2 = .061344
    ∂/∂student logprobs at (0, 1, 0) = (p − q) · 1/3 · 1/2 = [−.066667, +.066667]; 0 everywhere else
    max_prefix = 1: L_0 = .368064, loss = .184032
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, objective_for, rollout_from, train_recorded

from groupwise.losses.ssopd import select_witness_pairs, ssopd_loss, token_divergence
from groupwise.registry import build
from groupwise.types import Need
from groupwise.views.sibling_hint import SPEC_TEMPLATE, pick_row, verdicts

KL_SPEC = 0.9 * math.log(1.8) + 0.1 * math.log(0.2)  # .368064
TEACHER = "policy@sibling_hint.logprobs"


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_witness_pairs():
    pos, neg, valid, w = select_witness_pairs(torch.tensor([[5, 3, 7, 4]]), torch.tensor([[1, 1, 0, 0]]).bool())
    assert pos.tolist() == [1] and neg.tolist() == [2] and valid.tolist() == [True]
    _close(w, [1.0])


def test_spec_all_correct_all_wrong_invalid():
    lengths = torch.tensor([[5, 3, 7, 4], [5, 3, 7, 4]])
    pos, neg, valid, w = select_witness_pairs(lengths, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]).bool())
    assert pos.tolist() == [1, -1] and neg.tolist() == [-1, 2]  # shortest correct / longest wrong exist, not both
    assert valid.tolist() == [False, False] and w.tolist() == [0.0, 0.0]


def test_ties_go_to_the_first_row():
    pos, neg, _, _ = select_witness_pairs(
        torch.tensor([[3, 3, 7, 7], [4, 2, 2, 4]]), torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0]]).bool()
    )
    assert pos.tolist() == [0, 1] and neg.tolist() == [2, 0]
    assert pick_row(torch.tensor([[4, 2, 2, 4]]), torch.tensor([[1, 1, 1, 1]]).bool(), "first").tolist() == [0]


def test_frontier_weight_by_hand():
    lengths = torch.tensor([[1, 2, 3, 4]] * 3)
    correct = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]).bool()
    members = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]]).bool()  # row (2,1) has no verdict
    _, neg, _, w = select_witness_pairs(lengths, correct, members)
    _close(w, [4 * 0.25 * 0.75, 4 * 0.75 * 0.25, 4 * (1 / 3) * (2 / 3)])  # .75, .75, 8/9
    assert neg.tolist() == [3, 3, 3]
    _, _, _, w = select_witness_pairs(lengths, correct, members, frontier="none")
    _close(w, [1.0, 1.0, 1.0])


def test_verdicts_exclude_nan_and_padding():
    members, correct = verdicts(torch.tensor([[1.0, float("nan"), 0.0, 2.0]]), torch.tensor([[1, 1, 1, 0]]).bool())
    assert members.tolist() == [[True, False, True, False]] and correct.tolist() == [[True, False, False, False]]


def test_spec_kl_and_its_gradient():
    student = torch.zeros(1, 1, 2, requires_grad=True)  # logits → p = [.5, .5]
    teacher = torch.log(torch.tensor([[[0.9, 0.1]]]))  # logits → q = [.9, .1]
    assert not teacher.requires_grad
    loss = ssopd_loss(student, teacher, torch.ones(1, 1, dtype=torch.bool), torch.ones(1))
    _close(loss, KL_SPEC)
    _close(loss, 0.368064)
    (grad,) = torch.autograd.grad(loss, student)
    _close(grad[0, 0], [-0.4, 0.4])  # p − q: the student moves toward the teacher's token 0
    with pytest.raises(ValueError, match="no gradient"):
        ssopd_loss(student, teacher.clone().requires_grad_(True), torch.ones(1, 1, dtype=torch.bool), torch.ones(1))


@pytest.mark.parametrize(
    "kind, tau, expected",
    [
        ("rkl", 1.0, 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)),  # .510826
        (
            "jsd",
            1.0,
            0.5 * (0.9 * math.log(0.9 / 0.7) + 0.1 * math.log(0.1 / 0.3))
            + 0.5 * (0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)),
        ),
        ("fkl", 2.0, 0.75 * math.log(1.5) + 0.25 * math.log(0.5)),  # .130812
    ],
)
def test_other_divergences_by_hand(kind, tau, expected):
    p, q = torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.9, 0.1]]))
    _close(token_divergence(p, q, torch.ones(1, dtype=torch.bool), kind, tau), [expected])


def test_divergence_is_zero_outside_the_mask_even_for_nan():
    p = torch.tensor([[math.log(0.5), math.log(0.5)], [float("nan"), float("inf")]], requires_grad=True)
    q = torch.tensor([[math.log(0.9), math.log(0.1)], [float("nan"), 1.0]])
    ell = token_divergence(p, q, torch.tensor([True, False]))
    _close(ell, [KL_SPEC, 0.0])
    (grad,) = torch.autograd.grad(ell.sum(), p)
    _close(grad, [[-0.4, 0.4], [0.0, 0.0]])  # p − q inside, exactly 0 at the padding
    one_hot = torch.tensor([[0.0, -float("inf")]])  # q = [1, 0]: 1·ln(1/.5) + 0·log 0 = ln 2
    _close(
        token_divergence(torch.log(torch.tensor([[0.5, 0.5]])), one_hot, torch.ones(1, dtype=torch.bool)),
        [math.log(2.0)],
    )


# ---------------------------------------------------------------------------------------------- the term
def _batch(rewards=((1.0, 0.0, 1.0, 0.0), (1.0, 1.0, 1.0, 1.0)), lengths=((2, 3, 1, 3), (3, 3, 3, 3))):
    """B=2, G=4, T=3, V=2: student uniform; teacher [.9,.1] at every group's longest wrong row (ties first), token 0."""
    lengths = torch.tensor(lengths)
    mask = torch.arange(3)[None, None, :] < lengths[..., None]  # [2,4,3]
    ro = rollout_from(torch.zeros(2, 4, 3), torch.zeros(2, 4), mask=mask, rewards=torch.tensor(rewards))
    teacher = torch.full((2, 4, 3, 2), math.log(0.5))  # [B,G,T,V]
    _, correct = verdicts(ro.rewards, ro.group_valid)
    _, neg, _, _ = select_witness_pairs(lengths, correct)
    for b, g in enumerate(neg.tolist()):
        if g >= 0:
            teacher[b, g, 0] = torch.log(torch.tensor([0.9, 0.1]))
    ro.set_extra(TEACHER, teacher, "token")
    student = torch.full((2, 4, 3, 2), math.log(0.5)).requires_grad_(True)  # [B,G,T,V]
    return ro, student


def _loss(ro, student, agg="group_mean", **params):
    term = build("objective", "ssopd", **params)
    obj = objective_for([term], "seq_mean_token_mean")
    info = info_for(3)
    out = {"logp": torch.zeros(ro.shape, requires_grad=True), "logprobs": student}
    loss = obj.loss(ro, out, obj.normalizers(ro, info), info)
    (grad,) = torch.autograd.grad(loss, student)
    return loss, grad, term, out


def test_term_by_hand_through_the_objective():
    ro, student = _batch()
    loss, grad, term, out = _loss(ro, student)
    _close(loss, KL_SPEC / 3 / 2)  # .061344
    expected = torch.zeros(2, 4, 3, 2)
    expected[0, 1, 0] = torch.tensor([-0.4, 0.4]) / 3 / 2
    _close(grad, expected)
    values = term(ro, out, info_for(3))  # [b,G]: the group's L on every row
    _close(values, [[KL_SPEC / 3] * 4, [0.0] * 4])
    stats = term.stats(ro, out)
    _close(stats["ssopd_div"], [[KL_SPEC / 3] * 4, [0.0] * 4])
    _close(stats["ssopd_pair"], [[1.0] * 4, [0.0] * 4])
    _close(stats["ssopd_weight"], [[1.0] * 4, [0.0] * 4])


def test_term_max_prefix_coef_and_frontier():
    ro, student = _batch(rewards=((1.0, 0.0, 0.0, 0.0), (1.0, 1.0, 1.0, 1.0)))  # p̂ = ¼ → w = .75
    loss, _, _, _ = _loss(ro, student, max_prefix=1)
    _close(loss, 0.75 * KL_SPEC / 2)
    loss, _, _, _ = _loss(ro, student, max_prefix=1, frontier="none", coef=2.0)
    _close(loss, 2.0 * KL_SPEC / 2)
    loss, _, _, _ = _loss(ro, student, max_prefix=2, kind="rkl")  # token 0: KL(p‖q); token 1: 0
    _close(loss, 0.75 * (0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)) / 2 / 2)


def test_all_correct_and_all_wrong_give_exactly_zero():
    ro, student = _batch(rewards=((1.0, 1.0, 1.0, 1.0), (0.0, 0.0, 0.0, 0.0)))
    ro.extras[TEACHER][:, :, 0] = torch.log(torch.tensor([0.9, 0.1]))  # a teacher that disagrees everywhere
    loss, grad, _, _ = _loss(ro, student)
    assert loss.item() == 0.0 and (grad == 0).all()


def test_nan_rewards_padding_and_removed_tokens():
    ro, student = _batch(rewards=((1.0, float("nan"), 1.0, 0.0), (1.0, 1.0, 1.0, 1.0)))
    # group 0: row 1 has no verdict; wrong rows = {3} (3 tokens) → y⁻ = 3; p̂ = 2/3 → w = 8/9
    ro.extras[TEACHER][0, 3, 0] = torch.log(torch.tensor([0.9, 0.1]))
    ro.extras[TEACHER][0, 1, 0] = torch.tensor([float("nan"), float("nan")])  # never read
    loss, grad, _, _ = _loss(ro, student)
    _close(loss, (8 / 9) * KL_SPEC / 3 / 2)
    assert (grad[0, 1] == 0).all() and torch.isfinite(grad).all()
    ro.group_valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()  # y⁻ now padding: no wrong row left
    loss, grad, _, _ = _loss(ro, student)
    assert loss.item() == 0.0 and (grad == 0).all()
    ro, student = _batch()
    ro.set_extra(
        "counted",
        torch.ones(2, 4, 3, dtype=torch.bool).index_put_(
            (torch.tensor([0]), torch.tensor([1]), torch.tensor([0])), torch.tensor(False)
        ),
        "token",
    )
    loss, grad, _, _ = _loss(ro, student)  # y⁻'s token 0 removed by a token weight: tokens 1, 2 remain, both 0
    assert loss.item() == 0.0 and (grad == 0).all()


def test_micro_batches_add_up_to_the_whole_batch():
    ro, student = _batch()
    term = build("objective", "ssopd")
    obj = objective_for([term], "seq_mean_token_mean")
    info = info_for(3)
    norms = obj.normalizers(ro, info)
    whole = obj.loss(ro, {"logp": torch.zeros(ro.shape), "logprobs": student}, norms, info)
    parts = sum(
        obj.loss(ro.select([b]), {"logp": torch.zeros(1, 4, 3), "logprobs": student[b : b + 1]}, norms, info)
        for b in range(2)
    )
    _close(parts, whole.item())


def test_needs_and_errors():
    term = build("objective", "ssopd")
    assert term.needs == (Need("logprobs", grad=True), Need("logprobs", view="sibling_hint"))
    assert build("objective", "ssopd", view="other").needs[1].key == "policy@other.logprobs"
    for bad, match in [
        ({"kind": "kl"}, "kind"),
        ({"frontier": "x"}, "frontier"),
        ({"tau": 0.0}, "tau"),
        ({"max_prefix": -1}, "max_prefix"),
        ({"max_prefix": 1.5}, "max_prefix"),
        ({"threshold": float("nan")}, "threshold"),
    ]:
        with pytest.raises(ValueError, match=match):
            build("objective", "ssopd", **bad)
    ro, student = _batch()
    del ro.extras[TEACHER]
    with pytest.raises(ValueError, match="teacher"):
        term(ro, {"logprobs": student}, info_for(3))


# ---------------------------------------------------------------------------------------------- the view
def _encode(text):
    return [ord(c) for c in text]


def _view_batch(rewards, completions, lengths):
    B, G = len(rewards), len(rewards[0])
    mask = torch.arange(4)[None, None, :] < torch.tensor(lengths)[..., None]
    return rollout_from(
        torch.zeros(B, G, 4),
        mask=mask,
        rewards=torch.tensor(rewards),
        completions=completions,
        meta=[{"prompt": "37+45=", "answer": "82"}, {"prompt": "1+2=", "answer": "3"}][:B],
        prompt_ids=[_encode("37+45="), _encode("1+2=")][:B],
    )


def test_view_shortest_correct_sibling_before_the_prompt():
    ro = _view_batch(
        [[1.0, 0.0, 1.0], [0.0, 0.0, float("nan")]], [["082", "83", "82"], ["4", "5", "3"]], [[4, 3, 3], [2, 2, 2]]
    )
    view = build("view", "sibling_hint")
    assert view._hints(ro).tolist() == [2, -1]  # group 1: no correct row (the NaN one has no verdict)
    edited = view.apply(ro, _encode)
    assert edited.prompt_ids == [_encode("Reference solution: 82\n37+45="), _encode("1+2=")]
    assert edited.actions is ro.actions and edited.extras is not ro.extras
    assert build("view", "sibling_hint", pick="longest").apply(ro, _encode).prompt_ids[0] == _encode(
        "Reference solution: 082\n37+45="
    )
    spec = build("view", "sibling_hint", template=SPEC_TEMPLATE).apply(ro, _encode).prompt_ids[0]
    assert spec == _encode("37+45=\n\nA correct solution:\n82\n\nNow solve it yourself:\n")
    other = build("view", "sibling_hint", template="{answer}|{hint}|{prompt}", threshold=0.5).apply(ro, _encode)
    assert other.prompt_ids[0] == _encode("82|82|37+45=")


def test_view_errors():
    ro = _view_batch([[1.0, 0.0]], [["82", "83"]], [[2, 2]])
    ro.rewards = None
    with pytest.raises(ValueError, match="not scored yet"):
        build("view", "sibling_hint").apply(ro, _encode)
    for template in ["{hint}", "{prompt}", "{}{prompt}{hint}"]:
        with pytest.raises(ValueError):
            build("view", "sibling_hint", template=template)
    with pytest.raises(ValueError, match="pick"):
        build("view", "sibling_hint", pick="random")


# ---------------------------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize(
    "packed,share_prefix,functional",
    [(True, False, True), (True, True, True), (True, False, False), (False, False, False)],
)
def test_logprobs_quantity_is_the_whole_next_token_distribution(packed, share_prefix, functional):
    """``logprobs`` [B,G,T,V] on every forward path equals a per-row forward's log_softmax; its entry at
    the sampled token is ``logp``; 0 outside the scored tokens; differentiable (the student's grad need)."""
    from test_forward import batch, naive_quantities, tiny_model

    from groupwise.policy.forward import completion_logprobs

    model = tiny_model()
    prompts, actions, mask, rows = batch()
    out = completion_logprobs(
        model,
        prompts,
        actions,
        mask,
        rows,
        packed=packed,
        share_prefix=share_prefix,
        functional=functional,
        quantities=["logp", "logprobs", "topk(2)"],
    )
    with torch.no_grad():
        _, _, ref = naive_quantities(model, prompts, actions, mask, rows, k=1, layer=0)
    scored = mask & rows[..., None]  # [B,G,T]
    assert out["logprobs"].shape == (2, 3, 6, 64)
    torch.testing.assert_close(out["logprobs"].detach(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(
        out["logprobs"].gather(-1, actions[..., None])[..., 0].detach(), out["logp"].detach(), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        out["logprobs"].topk(2, dim=-1).values.detach()[scored], out["topk(2)"].detach()[scored], atol=1e-6, rtol=0
    )
    assert (out["logprobs"][~scored] == 0).all()
    out["logprobs"][scored].exp()[:, 0].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("objective, estimator", [("ppo_clip", "grpo"), ("gspo", "sign")])
def test_composes_with_objectives_and_estimators(tmp_path, objective, estimator):
    rows, seen = train_recorded(
        tmp_path,
        objective,
        f'objective.terms=["{objective}", "ssopd"]',
        f'advantage.estimator="{estimator}"',
        "rollout.group_size=4",
        "rollout.prompts_per_step=6",
    )
    for row, batch in zip(rows, seen):
        teacher = batch.extras[TEACHER]  # [B,G,T,V] the no-grad teacher under the hint view
        assert not teacher.requires_grad
        _close(teacher.exp().sum(-1)[batch.row_mask], torch.ones(int(batch.row_mask.sum())), atol=1e-4)
        members, correct = verdicts(batch.rewards, batch.group_valid)
        pos, neg, valid, _ = select_witness_pairs(batch.mask.sum(-1), correct, members)
        # groups without a correct row keep their prompt: the teacher is the sampling policy itself
        plain = pos < 0
        got = teacher.gather(-1, batch.actions[..., None])[..., 0]  # [B,G,T]
        keep = batch.row_mask & plain[:, None, None]
        _close(got[keep], batch.logp_old[keep], atol=1e-4)
        rows_with_tokens = batch.row_mask.any(-1)  # [B,G] the rows the statistics average over
        neg_has_tokens = batch.row_mask[torch.arange(len(neg)), neg.clamp(min=0)].any(-1)  # [B]
        share = (valid & neg_has_tokens)[:, None].expand_as(rows_with_tokens)  # [B,G]
        assert math.isclose(row["ssopd_pair"], float(share[rows_with_tokens].float().mean()), abs_tol=1e-6)
        assert 0.0 < row["ssopd_pair"] and row["ssopd_div"] > 0.0  # mixed groups were there, and the teacher differs
