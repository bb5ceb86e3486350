"""GEAR (specs/32) and the ground_truth view, worked by hand.

Spec unit test (one sequence, population std)::

    d = [0.1, 0.1, 2.0, 0.3, 0.2, 1.5, 0.1]            Σ = 4.3 → μ = 4.3/7 = 0.614286
    d − μ = [−.514286, −.514286, 1.385714, −.314286, −.414286, .885714, −.514286]
    Σ (d − μ)² = 3·.264490 + 1.920204 + .098776 + .171633 + .784490 = 3.768571
    σ = √(3.768571/7) = √.538367 = 0.733742
    z = [−.70091, −.70091, 1.88856, −.42833, −.56462, 1.20712, −.70091]
    spikes z ≥ 1: t = 2, 5;  entropy 2.5 ≥ h_τ = 2.0 at t = 4 ends the segment of t = 2
    anchors = [0, 1, 2, 2, 4, 5, 5];  z* = [−.70091, −.70091, 1.88856, 1.88856, −.56462, 1.20712, 1.20712]
    A = −1 (sgn +1): w = 1 + .5 z* = [.64954, .64954, 1.94428, 1.94428, .71769, 1.60356, 1.60356]
    A = +1 (sgn −1): w = 1 − .5 z* = [1.35046, 1.35046, .05572 → .1, .1, 1.28231, .39644, .39644]
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, make_rollout, permute_rows, permute_tensor, random_perm

from groupwise.advantages.gear import entropy_threshold, gear_divergence, gear_segments, gear_weights, sequence_z
from groupwise.registry import build
from groupwise.types import Need

D = [0.1, 0.1, 2.0, 0.3, 0.2, 1.5, 0.1]
H = [0.5, 0.5, 0.5, 0.5, 2.5, 0.5, 0.5]
Z = [-0.70091, -0.70091, 1.88856, -0.42833, -0.56462, 1.20712, -0.70091]
ANCHORS = [0, 1, 2, 2, 4, 5, 5]
Z_STAR = [-0.70091, -0.70091, 1.88856, 1.88856, -0.56462, 1.20712, 1.20712]
W_NEG = [0.64954, 0.64954, 1.94428, 1.94428, 0.71769, 1.60356, 1.60356]
W_POS = [1.35046, 1.35046, 0.1, 0.1, 1.28231, 0.39644, 0.39644]
KL = "kl_to(ground_truth)"


def _t(x):
    return torch.tensor([x], dtype=torch.float32)  # [1,T]


def _close(actual, expected, atol=1e-4):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _spec_rollout(advs=(-1.0, 1.0), d=D, h=H):
    """B=2, G=2, T=7: group 0 holds the spec sequence twice (advantages ``advs``); group 1 is
    random filler with a masked tail full of NaN/garbage extras."""
    ro = make_rollout(2, 2, len(d), seed=5, awkward=False)
    ro.mask[0] = True
    ro.mask[1, :, 4:] = False
    ro.rewards = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    ro.advantages = torch.tensor([list(advs), [0.7, -0.7]])  # [B,G]
    kl = torch.rand(2, 2, len(d), generator=torch.Generator().manual_seed(0))  # [B,G,T]
    kl[0] = torch.tensor(d)
    kl[1, :, 4:] = float("nan")
    ent = torch.rand(2, 2, len(d), generator=torch.Generator().manual_seed(1))  # [B,G,T]
    ent[0] = torch.tensor(h)
    ent[1, :, 4:] = 1e6
    ro.set_extra(KL, kl, "token")
    ro.set_extra("entropy", ent, "token")
    return ro


# ---------------------------------------------------------------------------------------------- spec unit test
def test_spec_z_scores_population_std():
    d, m = _t(D), torch.ones(1, 7, dtype=torch.bool)
    mu, sigma = 4.3 / 7, math.sqrt(3.768571 / 7)
    assert abs(mu - 0.61429) < 1e-5 and abs(sigma - 0.73374) < 1e-5
    _close(sequence_z(d, m), [Z])


def test_spec_spikes_and_anchors():
    m = torch.ones(1, 7, dtype=torch.bool)
    anchor = gear_segments(_t(D), _t(H), m, kappa=1.0, h_tau=2.0)
    assert anchor.tolist() == [ANCHORS]
    assert anchor.dtype == torch.long
    z_star = sequence_z(_t(D), m).gather(-1, anchor)
    _close(z_star, [Z_STAR])


@pytest.mark.parametrize("adv, expected", [(-1.0, W_NEG), (1.0, W_POS), (0.0, W_POS)])  # sgn = −1 unless A < 0
def test_spec_weights(adv, expected):
    anchor = torch.tensor([ANCHORS])
    w = gear_weights(_t(D), anchor, torch.tensor([adv]), alpha=0.5, w_min=0.1, w_max=3.0, renorm=False)
    _close(w, [expected])
    assert w.min() >= 0.1  # 1 − .5·1.88856 = .05572 clipped at w_min


def test_spec_through_the_shaper_fixed_h_tau():
    # group 0 = the spec sequence with A = −1 and A = +1 → A·w; group 1 only shows its masked tail is 0
    ro = _spec_rollout()
    adv = build("advantage", "gear", h_tau=2.0)(ro, info_for(7))
    assert adv.shape == (2, 2, 7) and adv.dtype == torch.float32
    _close(adv[0, 0], [-w for w in W_NEG])
    _close(adv[0, 1], W_POS)
    assert torch.isfinite(adv).all() and (adv[1, :, 4:] == 0).all()


# ---------------------------------------------------------------------------------------------- entropy threshold
def test_batch_quantile_threshold_default():
    # the spec sequence twice: sorted entropies [0.5×12, 2.5×2], linear quantile at position
    # 0.9·13 = 11.7 → 0.5 + 0.7·(2.5 − 0.5) = 1.9 ≤ 2.5 → t = 4 is still a boundary
    h = torch.tensor([H, H])  # [2,7]
    assert abs(entropy_threshold(h, torch.ones(2, 7, dtype=torch.bool), 0.9) - 1.9) < 1e-6
    ro = _spec_rollout()
    ro.mask[1] = False  # only group 0 in the batch statistics; 1e6 garbage on masked tokens ignored
    adv = build("advantage", "gear")(ro, info_for(7))
    _close(adv[0, 0], [-w for w in W_NEG])


def test_batch_quantile_sees_the_whole_batch():
    # group 1: its 2×4 valid tokens get entropy 3.0 → batch = 12×0.5, 2×2.5, 8×3.0 (22 values);
    # position 0.9·21 = 18.9 → 3.0 > 2.5: t = 4 is no boundary and the segment of t = 2 runs to t = 4
    ro = _spec_rollout()
    ro.extras["entropy"][1, :, :4] = 3.0
    adv = build("advantage", "gear")(ro, info_for(7))
    # anchors [0,1,2,2,2,5,5] → A = −1: w[4] = 1 + .5·1.88856 = 1.94428
    _close(adv[0, 0], [-w for w in W_NEG[:4]] + [-1.94428] + [-w for w in W_NEG[5:]])
    assert entropy_threshold(ro.extras["entropy"], ro.row_mask, 0.9) == 3.0


def test_spike_that_is_also_a_boundary_is_a_spike():
    # entropy 2.5 at the spike t = 2 as well: it still opens its segment (anchors unchanged)
    h = list(H)
    h[2] = 2.5
    anchor = gear_segments(_t(D), _t(h), torch.ones(1, 7, dtype=torch.bool), 1.0, 2.0)
    assert anchor.tolist() == [ANCHORS]


# ---------------------------------------------------------------------------------------------- options
def test_token_only_ablation():
    # segments=False: z* = z → A = −1: w = 1 + .5 z, w[3] = 1 − .5·.42833 = .78584, w[6] = .64954
    anchor = gear_segments(_t(D), _t(H), torch.ones(1, 7, dtype=torch.bool), 1.0, 2.0, segments=False)
    assert anchor.tolist() == [list(range(7))]
    w = gear_weights(_t(D), anchor, torch.tensor([-1.0]))
    _close(w, [[0.64954, 0.64954, 1.94428, 0.78584, 0.71769, 1.60356, 0.64954]])


def test_renorm_mean_one():
    # Σ W_NEG = 2·.64954 + 2·1.94428 + .71769 + 2·1.60356 = 9.11245 → mean 1.30178; w/1.30178
    w = gear_weights(_t(D), torch.tensor([ANCHORS]), torch.tensor([-1.0]), renorm=True)
    _close(w, [[x / (9.11245 / 7) for x in W_NEG]])
    assert abs(float(w.mean()) - 1.0) < 1e-6


def test_masked_gap_ends_a_segment():
    # valid d = [.1, 2, .1, .1, .1] (t = 3 masked): μ = .48, σ = √(2.888/5) = .76, z = [−.5, 2, −.5, −.5, −.5]
    d = _t([0.1, 2.0, 0.1, 99.0, 0.1, 0.1])
    m = torch.tensor([[True, True, True, False, True, True]])
    h = torch.zeros(1, 6)
    _close(sequence_z(d, m), [[-0.5, 2.0, -0.5, 0.0, -0.5, -0.5]])
    assert gear_segments(d, h, m, 1.0, math.inf).tolist() == [[0, 1, 1, -1, 4, 5]]
    assert gear_segments(d, h, m, 1.0, math.inf, gap_is_boundary=False).tolist() == [[0, 1, 1, -1, 1, 1]]


def test_sampled_gap_divergence_equals_kl_path():
    # d = logp_old − logp under the view: choose logp_T = logp_old − d → same weights as the kl path
    ro = _spec_rollout()
    gear = build("advantage", "gear", divergence="sampled_gap", h_tau=2.0)
    assert [n.key for n in gear.needs] == ["logp", "policy@ground_truth.logp", "entropy"]
    ro.logp_old = -torch.rand(2, 2, 7, generator=torch.Generator().manual_seed(2))  # [B,G,T]
    ro.set_extra("policy@ground_truth.logp", ro.logp_old - torch.nan_to_num(ro.extras[KL]), "token")
    _close(gear(ro, info_for(7)), build("advantage", "gear", h_tau=2.0)(ro, info_for(7)), atol=1e-5)


def test_needs_follow_divergence_and_view():
    assert [n.key for n in build("advantage", "gear").needs] == [KL, "entropy"]
    assert all(not n.grad for n in build("advantage", "gear").needs)
    assert build("advantage", "gear", view="hint").needs[0] == Need("kl_to(hint)")


def test_token_advantages_from_an_earlier_shaper():
    # a [B,G,T] advantage equal to the broadcast [B,G] one gives the same output
    ro = _spec_rollout()
    gear = build("advantage", "gear", h_tau=2.0)
    seq = gear(ro, info_for(7))
    ro.advantages = ro.advantages[..., None].expand(2, 2, 7).clone()
    _close(gear(ro, info_for(7)), seq, atol=1e-6)


# ---------------------------------------------------------------------------------------------- divergence
def test_full_vocabulary_kl_by_hand():
    # row 0: p = softmax[0,0] = [.5,.5], q = softmax[0, ln3] = [.25,.75]
    #        KL = .5 ln(.5/.25) + .5 ln(.5/.75) = .5 ln(4/3) = .143841
    # row 1: p = softmax[ln3,0,0] = [.6,.2,.2], q = uniform 1/3
    #        KL = .6 ln 1.8 + .4 ln .6 = .352672 − .204330 = .148342 (V = 3, row 0 padded with −inf)
    ninf = -math.inf
    student = torch.tensor([[[0.0, 0.0, ninf], [1.0, 1.0, 1.0]], [[math.log(3), 0.0, 0.0], [5.0, -5.0, 0.0]]])
    teacher = torch.tensor([[[0.0, math.log(3), ninf], [4.0, 4.0, 4.0]], [[7.0, 7.0, 7.0], [float("nan"), 0.0, 0.0]]])
    mask = torch.tensor([[True, True], [True, False]])
    d = gear_divergence(student, teacher, mask)  # [2,2]
    # token (0,1): equal distributions (shifted logits) → 0; token (1,1) masked (NaN teacher) → 0;
    # the −inf logit of row 0 contributes 0·log 0 = 0, not NaN
    _close(d, [[0.5 * math.log(4 / 3), 0.0], [0.6 * math.log(1.8) + 0.4 * math.log(0.6), 0.0]], atol=1e-6)


# ---------------------------------------------------------------------------------------------- edge cases
def test_constant_divergence_and_single_token_give_weight_one():
    # σ_d = 0 → z = 0 → w = clip(1, .1, 3) = 1 → adv = A (constant row and one-token row)
    ro = _spec_rollout(advs=(-0.8, 0.6))
    ro.extras[KL][0, 0] = 0.3
    ro.mask[0, 1, 1:] = False
    adv = build("advantage", "gear")(ro, info_for(7))
    _close(adv[0, 0], [-0.8] * 7, atol=1e-7)
    _close(adv[0, 1], [0.6] + [0.0] * 6, atol=1e-7)
    assert sequence_z(torch.full((1, 4), 0.1), torch.ones(1, 4, dtype=torch.bool)).abs().max() == 0


def test_invalid_rows_nan_rewards_zero_advantage_and_nan_free():
    ro = _spec_rollout(advs=(0.0, 1.0))
    ro.group_valid[1, 0] = False
    ro.rewards[1, 1] = float("nan")
    ro.extras[KL][0, 1, 3] = float("nan")  # a non-finite d inside the mask: z = 0 there, out of μ, σ
    adv = build("advantage", "gear")(ro, info_for(7))
    assert torch.isfinite(adv).all()
    assert (adv[0, 0] == 0).all()  # A_i = 0
    assert (adv[1] == 0).all()  # invalid row, NaN-reward row
    assert (adv[0, 1] != 0).all()  # the NaN token keeps a finite non-zero weight


def test_errors_name_the_bad_input():
    with pytest.raises(ValueError, match="divergence"):
        build("advantage", "gear", divergence="topk")
    with pytest.raises(ValueError, match="w_min"):
        build("advantage", "gear", w_min=2.0, w_max=1.0)
    ro = _spec_rollout()
    del ro.extras["entropy"]
    with pytest.raises(ValueError, match="'entropy'.*kl_to"):
        build("advantage", "gear")(ro, info_for(7))
    ro.advantages = None
    with pytest.raises(ValueError, match="estimator"):
        build("advantage", "gear")(ro, info_for(7))


# ---------------------------------------------------------------------------------------------- composition
def test_row_permutation_permutes_output():
    ro = make_rollout(3, 4, 6, seed=11)
    g = torch.Generator().manual_seed(4)
    ro.set_extra(KL, torch.rand(3, 4, 6, generator=g) * 2, "token")
    ro.set_extra("entropy", torch.rand(3, 4, 6, generator=g) * 3, "token")
    gear = build("advantage", "gear")
    perm = random_perm(3, 4)
    adv = gear(ro, info_for(6))
    keep = ro.row_mask & torch.isfinite(ro.rewards)[..., None]  # [B,G,T]
    assert (adv[keep].abs() - ro.advantages[..., None].expand_as(adv)[keep].abs()).abs().max() > 0.1  # w ≠ 1 somewhere
    torch.testing.assert_close(gear(permute_rows(ro, perm), info_for(6)), permute_tensor(adv, perm))


def test_composes_with_estimator_and_objective():
    # grpo → gear → ppo_clip on a make_rollout batch whose extras are filled by hand
    ro = make_rollout(3, 4, 6, seed=12, binary=True)
    g = torch.Generator().manual_seed(5)
    ro.set_extra(KL, torch.rand(3, 4, 6, generator=g), "token")
    ro.set_extra("entropy", torch.rand(3, 4, 6, generator=g), "token")
    ro.advantages = build("advantage", "grpo")(ro, info_for(6))  # [B,G]
    adv = build("advantage", "gear")(ro, info_for(6))  # [B,G,T]
    ratio = torch.where(ro.row_mask, adv / ro.advantages[..., None], torch.ones(()))  # [B,G,T] = w where A ≠ 0
    w = ratio[ro.row_mask & (ro.advantages[..., None] != 0)]
    assert w.numel() > 0 and w.min() >= 0.1 - 1e-6 and w.max() <= 3.0 + 1e-6
    assert (adv[~ro.row_mask] == 0).all()
    ro.advantages = adv
    logp = ro.logp_old.clone().requires_grad_(True)
    loss = build("objective", "ppo_clip")(ro, {"logp": logp}, info_for(6))  # [B,G,T]
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # on-policy: ∂loss/∂logp = −adv_t, i.e. the GEAR token advantage
    torch.testing.assert_close(grad, -adv * ro.row_mask)


# ---------------------------------------------------------------------------------------------- view
def _encode(text):
    return [ord(c) for c in text]


def test_view_prompt_edit_before_prompt_by_default():
    ro = make_rollout(2, 3, 4, seed=0)
    ro.meta = [{"prompt": "37+45=", "answer": "82"}, {"prompt": "1+2=", "answer": "3", "id": 7}]
    view = build("view", "ground_truth")
    out = view.apply(ro, _encode)
    assert out.prompt_ids == [_encode("Reference solution: 82\n37+45="), _encode("Reference solution: 3\n1+2=")]
    assert ro.prompt_ids == [[1, 2, 3], [1, 2, 4]]  # the original is untouched
    assert out.actions is ro.actions and out.mask is ro.mask  # token axis unchanged
    out.set_extra("x", torch.zeros(2, 3, 4), "token")
    assert "x" not in ro.extras


def test_view_spec_placement_and_other_columns():
    from groupwise.views.ground_truth import SPEC_TEMPLATE

    ro = make_rollout(1, 2, 3, seed=0)
    ro.meta = [{"prompt": "37+45=", "answer": "82", "steps": "7+5=12"}]
    assert build("view", "ground_truth", template=SPEC_TEMPLATE).apply(ro, _encode).prompt_ids == [
        _encode("37+45=Reference solution: 82")
    ]
    tpl = "Gold {steps} -> {answer} {{ok}}\n{prompt}"
    assert build("view", "ground_truth", template=tpl).apply(ro, _encode).prompt_ids == [
        _encode("Gold 7+5=12 -> 82 {ok}\n37+45=")
    ]


def test_view_chat_prompt_edits_last_user_turn():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    ro = make_rollout(1, 2, 3, seed=0)
    ro.meta = [{"prompt": msgs, "answer": "4"}]
    seen = []
    build("view", "ground_truth").apply(ro, lambda p: seen.append(p) or [0])
    assert seen == [[msgs[0], {"role": "user", "content": "Reference solution: 4\n2+2="}]]
    assert msgs[1]["content"] == "2+2="


def test_view_errors_name_the_column():
    ro = make_rollout(2, 2, 3, seed=0)
    ro.meta = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}]
    with pytest.raises(ValueError, match=r"'answer'.*group 1.*\['prompt'\]"):
        build("view", "ground_truth").apply(ro, _encode)
    with pytest.raises(ValueError, match=r"'solution'.*\['answer', 'prompt'\]"):
        build("view", "ground_truth", template="{solution}\n{prompt}").apply(ro, _encode)
    with pytest.raises(ValueError, match="prompt"):
        build("view", "ground_truth", template="Reference solution: {answer}")
    with pytest.raises(ValueError, match="positional"):
        build("view", "ground_truth", template="{}{prompt}")
