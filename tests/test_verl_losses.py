"""verl-side objective terms — Clip-Cov, KL-Cov, GPG, DPPO (binary TV / KL), the entropy bonus — and
the target-entropy controller, worked by hand.

Conventions as in ``tests/test_losses.py``: ``d = logp - logp_old``, ``ratio = e^d``, values are per
token before aggregation and gradients are d(Σ values)/d(logp) unless an aggregation is named.

verl is not installed (and must not be): each "verl parity" test re-derives the numbers of the cited
verl function by hand — the arithmetic in comments, and for random tensors a transcription of the
function's steps written here — and prints the maximum absolute difference (run with ``-s``).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    info_for,
    leaf,
    make_logp,
    make_rollout,
    objective_for,
    permute_rows,
    permute_tensor,
    random_perm,
    rollout_from,
)

from groupwise import schedules
from groupwise.losses.clip_cov import token_priority
from groupwise.registry import build
from groupwise.types import Need

# 1.105171 1.221403 1.349859 1.491825 1.648721
E01, E02, E03, E04, E05 = (math.exp(x) for x in (0.1, 0.2, 0.3, 0.4, 0.5))


def _values_grad(term, mb, logp, info=None):
    values = term(mb, {"logp": logp}, info or info_for(mb.shape[2]))
    (grad,) = torch.autograd.grad(values[mb.row_mask].sum(), logp)
    return values.detach(), grad


def _col(xs):
    """[1,G,1] tensor from G numbers (one group, one token per row)."""
    return torch.tensor(xs, dtype=torch.float32).view(1, -1, 1)


def _report(name, ours, ref):
    diff = float((ours.detach() - ref).abs().max())
    print(f"verl parity {name}: max |diff| = {diff:.3g}")
    return diff


# ============================================================================================ Clip-Cov
def _clip_cov_case():
    # adv = [2, −2, 2, −2] (mean 0); logp_old = [−0.5, −2.5, −1.5, −1.5] (mean −1.5)
    # cov = (A − 0)·(logp_old + 1.5) = [2·1, −2·−1, 2·0, −2·0] = [2, 2, 0, 0] → candidates (1 < cov < 5): rows 0, 1
    # d = [0, 0, 0.1, 0.5]
    mb = rollout_from(
        _col([-0.5, -2.5, -1.5, -1.5]), torch.tensor([[2.0, -2.0, 2.0, -2.0]]), actions=torch.arange(4).view(1, 4, 1)
    )
    return mb, leaf(mb.logp_old + _col([0.0, 0.0, 0.1, 0.5]))


def test_clip_cov_by_hand_all_candidates_dropped():
    mb, logp = _clip_cov_case()
    # clip_cov_ratio = 0.5 → n_clip = max(int(0.5·4), 1) = 2 ≥ 2 candidates → rows 0 and 1 lose loss and gradient
    values, grad = _values_grad(build("objective", "clip_cov", clip_cov_ratio=0.5), mb, logp)
    # row 2: ratio e^0.1 = 1.1052 inside [0.8, 1.2], A = 2 → −2·1.1052 = −2.2103, grad −2.2103
    # row 3: ratio e^0.5 = 1.6487, A = −2 → max(3.2974, 2·1.2 = 2.4) = 3.2974 (unclipped), grad +3.2974
    torch.testing.assert_close(values.flatten(), torch.tensor([0.0, 0.0, -2 * E01, 2 * E05]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([0.0, 0.0, -2 * E01, 2 * E05]))


def test_clip_cov_default_draws_one_candidate_uniformly():
    mb, logp = _clip_cov_case()
    term = build("objective", "clip_cov")  # 2e-4·4 tokens → n_clip = max(0, 1) = 1 of the 2 candidates
    picks = []
    for step in range(40):
        info = info_for(1, step=step)
        values, _ = _values_grad(term, mb, logp, info)
        dropped = (values.flatten()[:2] == 0).tolist()
        assert sum(dropped) == 1  # exactly one; the other keeps its PPO loss: row 0 −2·1 = −2, row 1 +2·1 = 2
        assert values.flatten()[0].item() in (0.0, -2.0) and values.flatten()[1].item() in (0.0, 2.0)
        assert torch.equal(values, _values_grad(term, mb, logp, info)[0])  # same (seed, step) → same draw
        picks.append(dropped.index(True))
    assert 8 <= sum(picks) <= 32, picks  # both rows are drawn, roughly half each (Binomial(40, ½))


def test_clip_cov_bounds_are_strict_and_no_candidate_is_ppo():
    mb, logp = _clip_cov_case()
    ppo = build("objective", "ppo_clip")(mb, {"logp": logp}, info_for(1))
    # cov = 2 exactly: with lb = 2 it is not a candidate (cov > lb is strict) → plain PPO-clip everywhere
    for params in ({"clip_cov_lb": 2.0}, {"clip_cov_ub": 2.0}, {"clip_cov_lb": 3.0, "clip_cov_ub": 5.0}):
        values = build("objective", "clip_cov", clip_cov_ratio=1.0, **params)(mb, {"logp": logp}, info_for(1))
        torch.testing.assert_close(values, ppo)


def test_clip_cov_constant_group_and_masked_tokens():
    # adv all 0 → cov 0 → nothing selected, loss 0; a masked token with garbage logp_old stays out
    mb = rollout_from(
        torch.tensor([[[-1.0, 40.0], [-2.0, -1.0]]]), torch.zeros(1, 2), mask=torch.tensor([[[1, 0], [1, 1]]])
    )
    logp = leaf([[[-0.9, 3.0], [-2.1, -1.0]]])
    values, grad = _values_grad(build("objective", "clip_cov", clip_cov_lb=-1.0, clip_cov_ratio=1.0), mb, logp)
    assert torch.isfinite(values).all() and values.abs().sum() == 0 and grad.abs().sum() == 0


def test_clip_cov_current_mode_excludes_clipped_verl_parity():
    # verl compute_policy_loss_clip_cov (core_algos.py): cov from the CURRENT log_prob, PPO-clipped tokens set to
    # −inf before drawing. logp_old = −1 everywhere, d = [0.5, −0.1, 0, 0] → logp = [−0.5, −1.1, −1, −1], mean −0.9
    # adv = [3, −6, 2, 1] (mean 0) → cov = [3·0.4, −6·−0.2, 2·−0.1, 1·−0.1] = [1.2, 1.2, −0.2, −0.1]: candidates 0, 1
    # row 0: ratio 1.6487 > 1.2, A > 0 → clipped (pg2 = −3.6 > pg1 = −4.946) → not drawable; n_clip = 1 → row 1
    mb = rollout_from(_col([-1.0] * 4), torch.tensor([[3.0, -6.0, 2.0, 1.0]]))
    logp = leaf(mb.logp_old + _col([0.5, -0.1, 0.0, 0.0]))
    values, grad = _values_grad(build("objective", "clip_cov", cov_logp="current"), mb, logp)
    # row 0: max(−4.946, −3.6) = −3.6, grad 0 | row 1: dropped → 0 | row 2: −2·1 = −2 | row 3: −1·1 = −1
    expected = torch.tensor([-3.6, 0.0, -2.0, -1.0])
    _report("clip_cov (hand, current)", values.flatten(), expected)
    torch.testing.assert_close(values.flatten(), expected)
    torch.testing.assert_close(grad.flatten(), torch.tensor([0.0, 0.0, -2.0, -1.0]))
    # "old": cov from logp_old (all −1 → centred 0 → cov 0): nothing drawn, row 1 keeps 6·e^−0.1 = 5.4290, grad 5.4290
    values, grad = _values_grad(build("objective", "clip_cov"), mb, logp)
    torch.testing.assert_close(values.flatten(), torch.tensor([-3.6, 6 * math.exp(-0.1), -2.0, -1.0]))


def _verl_clip_cov(old, logp, adv, mask, ratio_c, lb, ub, eps):
    """verl compute_policy_loss_clip_cov on [N,T] (all candidates drawn: clip_num ≥ #candidates)."""
    m = mask.float()
    ratio = torch.exp(logp - old)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps)
    clip_by_origin = (pg2 > pg1) & (m > 0)
    cov = (adv - (adv * m).sum() / m.sum()) * (logp - (logp * m).sum() / m.sum())
    cov[m == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_c * m.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (m > 0))
    assert len(idx) <= clip_num  # no random draw needed
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    return torch.maximum(pg1, pg2) * corr


@pytest.mark.parametrize("seed", [0, 1])
def test_clip_cov_verl_parity_random(seed):
    ro = make_rollout(4, 4, 6, seed=seed, awkward=False, token_adv=True)
    logp = make_logp(ro, seed=seed + 3)
    N = 16
    ref = _verl_clip_cov(
        ro.logp_old.view(N, 6),
        logp.detach().view(N, 6),
        ro.advantages.view(N, 6),
        ro.mask.view(N, 6),
        1.0,
        0.05,
        5.0,
        0.2,
    )
    ref = ref.view(4, 4, 6)
    ours = build("objective", "clip_cov", clip_cov_ratio=1.0, clip_cov_lb=0.05, cov_logp="current")(
        ro, {"logp": logp}, info_for(6)
    )
    m = ro.mask
    assert (ref[m] == 0).sum() >= 3  # the statistic really dropped tokens
    assert _report(f"clip_cov (random, seed {seed})", ours[m], ref[m]) < 1e-6
    # on-policy (logp_old = logp) the "old" statistic is verl's exactly
    ro.logp_old = logp.detach().clone()
    ref = _verl_clip_cov(
        ro.logp_old.view(N, 6), logp.detach().view(N, 6), ro.advantages.view(N, 6), m.view(N, 6), 1.0, 0.05, 5.0, 0.2
    ).view(4, 4, 6)
    ours = build("objective", "clip_cov", clip_cov_ratio=1.0, clip_cov_lb=0.05)(ro, {"logp": logp}, info_for(6))
    assert _report(f"clip_cov (on-policy old, seed {seed})", ours[m], ref[m]) < 1e-6


def test_token_priority_is_row_order_and_padding_free():
    ro = make_rollout(3, 4, 5, seed=2)
    u = token_priority(ro, info_for(5, step=3))
    assert u.dtype == torch.float64 and (u >= 0).all() and (u < 1).all()
    perm = random_perm(3, 4)
    torch.testing.assert_close(
        token_priority(permute_rows(ro, perm), info_for(5, step=3)), permute_tensor(u, perm), atol=0, rtol=0
    )
    torch.testing.assert_close(token_priority(ro.pad_tokens(8), info_for(8, step=3))[..., :5], u, atol=0, rtol=0)
    assert not torch.equal(token_priority(ro, info_for(5, step=4)), u)  # a new step draws anew
    assert u[ro.mask].unique().numel() == int(ro.mask.sum())  # distinct rows and positions: no ties


# ============================================================================================ KL-Cov
def _kl_cov_case():
    # adv = [2, −2, 2, −2]; logp_old = [−0.5, −2, −1.5, −2] (mean −1.5) → centred [1, −0.5, 0, −0.5]
    # cov = [2, 1, 0, 1]; d = [0.2, 0, 0.4, 0.3]
    mb = rollout_from(_col([-0.5, -2.0, -1.5, -2.0]), torch.tensor([[2.0, -2.0, 2.0, -2.0]]))
    return mb, leaf(mb.logp_old + _col([0.2, 0.0, 0.4, 0.3]))


@pytest.mark.parametrize("cov_logp", ["old", "current"])
def test_kl_cov_by_hand(cov_logp):
    mb, logp = _kl_cov_case()
    # k = max(1, int(4·2e-4)) = 1 → the top covariance: row 0 (old: cov 2; current: logp = [−0.3, −2, −1.1, −1.7],
    # mean −1.275, cov = [1.95, 1.45, 0.35, 0.85] → also row 0)
    values, grad = _values_grad(build("objective", "kl_cov", cov_logp=cov_logp), mb, logp)
    expected = [
        -2 * E02 + 0.1 * 0.2,  # row 0: −A·ratio + 0.1·|d| = −2.4428 + 0.02 = −2.4228
        2.0,  # row 1: ratio 1, A = −2 → +2
        -2 * E04,  # row 2: ratio 1.4918 > 1.2 with A > 0: NO clip in KL-Cov → −2.9836
        2 * E03,  # row 3: +2·1.3499 = 2.6997
    ]
    # grads: −A·ratio (+ 0.1·sign(d) on row 0) = [−2.4428 + 0.1, 2, −2.9836, 2.6997]
    torch.testing.assert_close(values.flatten(), torch.tensor(expected))
    torch.testing.assert_close(grad.flatten(), torch.tensor([-2 * E02 + 0.1, 2.0, -2 * E04, 2 * E03]))


def test_kl_cov_selects_exactly_k_ties_to_the_earlier_row():
    mb, logp = _kl_cov_case()
    # kl_cov_ratio = 0.5 → k = 2: row 0 (cov 2), then rows 1 and 3 tie at cov 1 → the earlier, row 1
    term = build("objective", "kl_cov", kl_cov_ratio=0.5)
    assert term.stats(mb, {"logp": logp})["cov_kl"].flatten().tolist() == [1, 1, 0, 0]
    values, grad = _values_grad(term, mb, logp)
    # row 1: |d| = 0 adds nothing, so the values equal the k = 1 case
    torch.testing.assert_close(values.flatten(), torch.tensor([-2 * E02 + 0.02, 2.0, -2 * E04, 2 * E03]))
    # kl_cov_ratio = 0.75 → k = 3: rows 0, 1, 3; row 3: 2.6997 + 0.1·0.3 = 2.7297, grad 2.6997 + 0.1
    values, grad = _values_grad(build("objective", "kl_cov", kl_cov_ratio=0.75), mb, logp)
    torch.testing.assert_close(values.flatten(), torch.tensor([-2 * E02 + 0.02, 2.0, -2 * E04, 2 * E03 + 0.03]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([-2 * E02 + 0.1, 2.0, -2 * E04, 2 * E03 + 0.1]))


def _verl_kl_cov(old, logp, adv, mask, ratio_k, coef):
    """verl compute_policy_loss_kl_cov on [N,T]."""
    d = logp - old
    pg = -adv * torch.exp(d)
    pg_kl = pg + coef * d.abs()
    valid = mask > 0
    idx_all = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].reshape(-1), logp[valid].reshape(-1)
    cov = (a - a.mean()) * (lp - lp.mean())
    top = idx_all[torch.topk(cov, max(1, int(len(cov) * ratio_k))).indices]
    out = pg.clone()
    out[top // adv.shape[1], top % adv.shape[1]] = pg_kl[top // adv.shape[1], top % adv.shape[1]]
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_kl_cov_verl_parity_random(seed):
    ro = make_rollout(4, 4, 6, seed=seed, awkward=False, token_adv=True)
    logp = make_logp(ro, seed=seed + 3)
    N, m = 16, ro.mask
    ref = _verl_kl_cov(
        ro.logp_old.view(N, 6), logp.detach().view(N, 6), ro.advantages.view(N, 6), m.view(N, 6), 0.1, 1.0
    ).view(4, 4, 6)
    ours = build("objective", "kl_cov", kl_cov_ratio=0.1, kl_coef=1.0, cov_logp="current")(
        ro, {"logp": logp}, info_for(6)
    )
    assert _report(f"kl_cov (random, seed {seed})", ours[m], ref[m]) < 1e-6


# ============================================================================================ whole-batch statistic
@pytest.mark.parametrize(
    "name,params",
    [
        ("clip_cov", {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.0, "clip_cov_ub": 100.0}),
        ("kl_cov", {"kl_cov_ratio": 0.1, "kl_coef": 1.0}),
    ],
)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_cov_terms_do_not_depend_on_the_micro_batch_split(name, params, agg):
    B, G, T = 8, 4, 6
    ro = make_rollout(B, G, T, seed=5)
    info = info_for(T, step=2)
    term = build("objective", name, **params)
    assert Need("logp") in term.needs  # logp_old exists for the whole batch before micro-batching
    term.prepare(ro, info)  # once per step, on the whole batch: the selection travels as a token extra
    assert ro.extra_levels[f"{name}.select"] == "token" and ro.extras[f"{name}.select"].sum() > 2
    obj = objective_for([term], agg)
    norms = obj.normalizers(ro, info)
    logp = make_logp(ro, scale=0.05)
    whole = obj.loss(ro, {"logp": logp}, norms, info)
    (g_whole,) = torch.autograd.grad(whole, logp)
    split = [[0, 5], [1], [2, 3, 7], [4, 6]]
    logp2 = logp.detach().clone().requires_grad_(True)
    total = sum(obj.loss(ro.select(i), {"logp": logp2[i]}, norms, info) for i in split)
    total.backward()
    torch.testing.assert_close(total.detach(), whole.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logp2.grad, g_whole, atol=1e-6, rtol=1e-6)
    # guard: the statistic is batch-coupled — computed per micro-batch (verl's scope) the loss differs
    bare = build("objective", name, **params)
    ro_bare = make_rollout(B, G, T, seed=5)
    obj_bare = objective_for([bare], agg)
    per_mb = sum(obj_bare.loss(ro_bare.select(i), {"logp": logp.detach()[i]}, norms, info) for i in split)
    assert not torch.allclose(per_mb, whole.detach(), atol=1e-4)
    # ... and without prepare the whole batch computes the same selection as prepare did
    torch.testing.assert_close(obj_bare.loss(ro_bare, {"logp": logp.detach()}, norms, info), whole.detach())


def test_prepare_selection_equals_the_in_call_one_and_is_refreshed():
    ro = make_rollout(4, 4, 6, seed=8)
    term = build("objective", "clip_cov", clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=100.0)
    out = {"logp": ro.logp_old.clone()}
    direct = term._selection(ro, out, info_for(6, step=1))
    term.prepare(ro, info_for(6, step=1))
    assert torch.equal(ro.extras["clip_cov.select"], direct)
    term.prepare(ro, info_for(6, step=2))  # a later step replaces, never reuses, the stored selection
    assert torch.equal(
        ro.extras["clip_cov.select"], term._selection(_without(ro, "clip_cov.select"), out, info_for(6, step=2))
    )


def _without(ro, key):
    copy = ro.select(list(range(ro.shape[0])))
    copy.extras.pop(key)
    return copy


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_cov_terms_reject_bad_parameters(name):
    key = "clip_cov_ratio" if name == "clip_cov" else "kl_cov_ratio"
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="share"):
            build("objective", name, **{key: bad})
    with pytest.raises(ValueError, match="cov_logp"):
        build("objective", name, cov_logp="new")


# ============================================================================================ GPG
def test_gpg_by_hand_token_mean_and_verl_parity():
    # rows A = [1, −0.5]; logp = [[−1, −2], [−0.5, pad 7]] → values −A·logp = [[1, 2], [−0.25, ·]]
    mb = rollout_from(torch.zeros(1, 2, 2), torch.tensor([[1.0, -0.5]]), mask=torch.tensor([[[1, 1], [1, 0]]]))
    logp = leaf([[[-1.0, -2.0], [-0.5, 7.0]]])
    term = build("objective", "gpg")
    values = term(mb, {"logp": logp}, info_for(2))
    torch.testing.assert_close(values[mb.mask], torch.tensor([1.0, 2.0, -0.25]))
    obj = objective_for([term], "seq_mean_token_mean")  # GPG keeps its own token_mean
    loss = obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(2)), info_for(2))
    (grad,) = torch.autograd.grad(loss, logp)
    # token mean over 3 tokens: (1 + 2 − 0.25)/3 = 0.916667; d/dlogp = −A/3 = [[−1/3, −1/3], [1/6, 0]]
    # verl compute_policy_loss_gpg + agg_loss("token-mean"): masked_sum(−logp·A)/batch_num_tokens = 2.75/3
    _report("gpg (hand)", loss.detach(), torch.tensor(2.75 / 3))
    assert loss.item() == pytest.approx(2.75 / 3, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[[-1 / 3, -1 / 3], [1 / 6, 0.0]]]))
    assert term.agg == "token_mean" and term.needs == ()


def test_gpg_ignores_logp_old_and_equals_reinforce_per_token():
    ro = make_rollout(3, 4, 5, seed=4)
    logp = make_logp(ro)
    a = build("objective", "gpg")(ro, {"logp": logp}, info_for(5))
    ro.logp_old = ro.logp_old + 1.0
    b = build("objective", "gpg")(ro, {"logp": logp}, info_for(5))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a, build("objective", "reinforce")(ro, {"logp": logp}, info_for(5)))


# ============================================================================================ DPPO
def _dppo_case(p, q, adv):
    mb = rollout_from(_col([math.log(x) for x in q]), torch.tensor([adv]))
    return mb, leaf(_col([math.log(x) for x in p]))


def test_dppo_tv_by_hand():
    # q = 0.5 everywhere, p = [0.8, 0.6, 0.2, 0.9], A = [1, 1, −1, −1], δ = 0.15 (verl's default)
    mb, logp = _dppo_case([0.8, 0.6, 0.2, 0.9], [0.5] * 4, [1.0, 1.0, -1.0, -1.0])
    term = build("objective", "dppo_tv")
    values, grad = _values_grad(term, mb, logp)
    # t0: A > 0, p − q = 0.3 > 0.15 → outside → 0 |
    # t1: 0.1 ≤ 0.15, w = 0.6/0.5 = 1.2 → −1.2·ln 0.6 = 0.612991, grad −1.2
    # t2: A < 0, p − q = −0.3 < −0.15 → outside | t3: A < 0, p − q = +0.4 ≥ −0.15 → inside, w = 1.8 → 1.8·ln 0.9
    # = −0.189649, grad +1.8 (PPO would not clip it either; a ratio cap of 1.2 would for A > 0)
    torch.testing.assert_close(values.flatten(), torch.tensor([0.0, -1.2 * math.log(0.6), 0.0, 1.8 * math.log(0.9)]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([0.0, -1.2, 0.0, 1.8]))
    assert term.stats(mb, {"logp": logp})["tr_masked"].flatten().tolist() == [1, 0, 1, 0]


def test_dppo_truncated_importance_weight():
    # q = 0.01, p = 0.9, A = −1: ratio 90 → w = min(90, C = 3) = 3 (verl's configured clip_ratio_c; its
    # in-code fallback 20 is never reached); p − q = 0.89 ≥ −δ → inside: loss 3·ln 0.9 = −0.316082, grad +3
    mb, logp = _dppo_case([0.9], [0.01], [-1.0])
    for name in ("dppo_tv", "dppo_kl"):
        for c, kw in ((3.0, {}), (20.0, {"clip_ratio_c": 20.0})):  # the default, then verl's in-code fallback
            values, grad = _values_grad(build("objective", name, **kw), mb, logp)
            assert values.item() == pytest.approx(c * math.log(0.9), rel=1e-5)
            assert grad.item() == pytest.approx(c, rel=1e-5)
        assert build("objective", name).stats(mb, {"logp": logp})["is_truncated"].item() == 1.0


def test_dppo_kl_by_hand():
    # q = 0.5, p = [0.6, 0.7, 0.7, 0.3], A = [1, 1, −1, −1], δ = 0.05
    # binary KL(q‖p) = q ln(q/p) + (1−q) ln((1−q)/(1−p)):
    #   p = 0.6: 0.5·ln(0.5/0.6) + 0.5·ln(0.5/0.4) = 0.5·(−0.182322) + 0.5·0.223144 = 0.020411 ≤ 0.05
    #   p = 0.7 or 0.3: 0.5·(−0.336472) + 0.5·0.510826 = 0.087177 > 0.05
    mb, logp = _dppo_case([0.6, 0.7, 0.7, 0.3], [0.5] * 4, [1.0, 1.0, -1.0, -1.0])
    values, grad = _values_grad(build("objective", "dppo_kl"), mb, logp)
    # t0 inside: −1.2·ln 0.6 = 0.612991, grad −1.2 | t1: KL too big and p > q with A > 0 → out
    # t2: A < 0 but p > q (moving away from the decrease) → inside:
    # 1.4·ln 0.7 = −0.499345, grad 1.4 | t3: p < q, KL big → out
    torch.testing.assert_close(values.flatten(), torch.tensor([-1.2 * math.log(0.6), 0.0, 1.4 * math.log(0.7), 0.0]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([-1.2, 0.0, 1.4, 0.0]))


def test_dppo_sampler_anchor():
    mb, logp = _dppo_case([0.8, 0.6, 0.2, 0.9], [0.5] * 4, [1.0, 1.0, -1.0, -1.0])
    expected = build("objective", "dppo_tv")(mb, {"logp": logp}, info_for(1))
    mb.logp_sampler, mb.logp_old = mb.logp_old, mb.logp_old + 5.0  # anchor moved to the sampler; logp_old is ignored
    torch.testing.assert_close(
        build("objective", "dppo_tv", anchor="sampler")(mb, {"logp": logp}, info_for(1)), expected
    )
    mb.logp_sampler = None
    with pytest.raises(ValueError, match="logp_sampler"):
        build("objective", "dppo_tv", anchor="sampler")(mb, {"logp": logp}, info_for(1))
    with pytest.raises(ValueError, match="anchor"):
        build("objective", "dppo_kl", anchor="ref")


def _verl_dppo(old, logp, adv, kind, d_low, d_high, c=3.0):
    """verl compute_policy_loss_dppo_tv / _kl per token (before agg_loss)."""
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    w = torch.clamp(ratio, max=c).detach()
    p, q = torch.exp(logp), torch.exp(old)
    if kind == "tv":
        pos, neg = (p - q) <= d_high, (p - q) >= -d_low
    else:
        kl = q * (old - logp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        pos, neg = (kl <= d_high) | (p <= q), (kl <= d_low) | (p >= q)
    valid = torch.where(adv > 0, pos, neg).detach().float()
    return -adv * w * logp * valid


@pytest.mark.parametrize("kind,delta", [("tv", 0.15), ("kl", 0.05)])
def test_dppo_verl_parity_random(kind, delta):
    ro = make_rollout(4, 4, 6, seed=7, awkward=False, token_adv=True)
    logp = make_logp(ro, scale=0.6).detach()
    m = ro.mask
    push = (m & (ro.advantages < 0)).flatten().nonzero().flatten()[:3]  # 3 tokens with A < 0 (inside: p > q)
    logp.view(-1)[push] = ro.logp_old.reshape(-1)[push] + 1.5  # ratio e^1.5 = 4.48 > C = 3: the cap binds
    ref = _verl_dppo(ro.logp_old, logp, ro.advantages, kind, delta, delta)
    ours = build("objective", f"dppo_{kind}")(ro, {"logp": logp}, info_for(6))
    outside = (ref[m] == 0) & (ro.advantages[m] != 0)
    assert 0 < int(outside.sum()) < int(m.sum())  # the trust region binds on some tokens, not all
    assert ((logp - ro.logp_old).exp()[m & (ref != 0)] > 3.0).any()  # and the cap C = 3 on some inside it
    assert _report(f"dppo_{kind} (random)", ours[m], ref[m]) < 1e-6


# ============================================================================================ entropy bonus
def _entropy_case():
    mb = rollout_from(torch.zeros(1, 2, 2), torch.zeros(1, 2), mask=torch.tensor([[[1, 1], [1, 0]]]))
    return mb, leaf([[[0.5, 1.0], [2.0, 9.9]]])  # H; 9.9 sits on padding


@pytest.mark.parametrize(
    "agg,expected",
    [
        ("token_mean", -0.01 * 3.5 / 3),  # −coef·(0.5 + 1 + 2)/3 = −0.0116667
        ("seq_mean_token_mean", -0.01 * 1.375),  # rows 0.75 and 2.0 → mean 1.375 → −0.01375
    ],
)
def test_entropy_bonus_by_hand_and_verl_parity(agg, expected):
    # verl dp_actor.update_policy: policy_loss −= agg_loss(entropy, response_mask, loss_agg_mode) · entropy_coeff
    mb, H = _entropy_case()
    term = build("objective", "entropy_bonus", coef=0.01)
    obj = objective_for([term], agg)
    mb.weight = torch.full((1, 2, 2), 0.5)  # not weighted (verl: IS weights scale the policy loss only)
    loss = obj.loss(
        mb, {"logp": leaf(torch.zeros(1, 2, 2)), "entropy": H}, obj.normalizers(mb, info_for(2)), info_for(2)
    )
    (grad,) = torch.autograd.grad(loss, H)
    _report(f"entropy_bonus ({agg})", loss.detach(), torch.tensor(expected))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert grad[0, 1, 1] == 0 and (grad[mb.mask] < 0).all()  # raising H lowers the loss; padding gets nothing
    if agg == "token_mean":
        torch.testing.assert_close(grad[mb.mask], torch.full((3,), -0.01 / 3))


def test_entropy_bonus_needs_and_errors():
    term = build("objective", "entropy_bonus")
    # whole-batch H for the controller
    assert Need("entropy", grad=True) in term.needs and Need("entropy") in term.needs
    mb, _ = _entropy_case()
    with pytest.raises(ValueError, match="entropy"):
        term(mb, {"logp": leaf(torch.zeros(1, 2, 2))}, info_for(2))


# ============================================================================================ target entropy
def _entropy_batch(h, garbage=50.0):
    mb = rollout_from(torch.zeros(1, 2, 2), torch.zeros(1, 2), mask=torch.tensor([[[1, 1], [1, 0]]]))
    mb.set_extra("entropy", torch.tensor([[[h, h], [h, garbage]]]), "token")  # the padded token never counts
    return mb


def _skywork(hs, init=0.0, delta=1e-4, lo=0.0, hi=0.005, target=0.2):
    """Skywork-OR1 EntController.update + entropy_loss_enabled, by hand: realised coef after each H."""
    value, out = init, []
    for h in hs:
        value = min(max(value + (delta if h < target else -delta), lo), hi)
        out.append(value * (h < target))
    return out


def test_target_entropy_additive_by_hand_and_skywork_parity():
    s = build("schedule", "target_entropy")
    assert s.start() == 0.0
    hs = [0.1, 0.1, 0.3, 0.1, 0.2]
    got = [s(info_for(2, step=i), _entropy_batch(h)) for i, h in enumerate(hs)]
    # 0.1 < 0.2: 0 + 1e-4 | again: 2e-4 | 0.3 ≥ 0.2: value 1e-4, gate closed → 0 | 0.1: 2e-4 |
    # 0.2 = target: falls to 1e-4, closed → 0
    expected = [1e-4, 2e-4, 0.0, 2e-4, 0.0]
    assert got == pytest.approx(expected, abs=1e-12)
    assert _report("target_entropy vs Skywork EntController", torch.tensor(got), torch.tensor(_skywork(hs))) < 1e-12


def test_target_entropy_bounds():
    s = build("schedule", "target_entropy")
    for i in range(60):  # 60 · 1e-4 = 6e-3 → capped at coef_max 5e-3
        v = s(info_for(2, step=i), _entropy_batch(0.0))
    assert v == pytest.approx(5e-3)
    s = build("schedule", "target_entropy", gate=False)
    assert s(info_for(2), _entropy_batch(1.0)) == 0.0  # 0 − 1e-4 → floored at coef_min 0


def test_target_entropy_multiplicative_by_hand():
    s = build("schedule", "target_entropy", mode="multiplicative", init=0.01, lr=2.0, gate=False, coef_max=1.0)
    # H = 0.1: 0.01·e^{2·(0.2 − 0.1)} = 0.01·e^0.2 = 0.0122140 | H = 0.4: ·e^{2·(−0.2)} → 0.01·e^−0.2 = 0.0081873
    assert s(info_for(2), _entropy_batch(0.1)) == pytest.approx(0.01 * E02, rel=1e-6)  # H is float32
    assert s(info_for(2), _entropy_batch(0.4)) == pytest.approx(0.01 * math.exp(-0.2), rel=1e-6)
    with pytest.raises(ValueError, match="init > 0"):
        build("schedule", "target_entropy", mode="multiplicative")


def test_target_entropy_resume_equals_uninterrupted():
    hs = [0.05, 0.3, 0.1, 0.1, 0.25, 0.15]
    whole = build("schedule", "target_entropy", delta=1e-3)
    ref = [whole(info_for(2, step=i), _entropy_batch(h)) for i, h in enumerate(hs)]
    first = build("schedule", "target_entropy", delta=1e-3)
    got = [first(info_for(2, step=i), _entropy_batch(h)) for i, h in enumerate(hs[:3])]
    resumed = build("schedule", "target_entropy", delta=1e-3)
    resumed.load_state_dict(first.state_dict())
    assert resumed.start() == got[-1]  # the component is rebuilt with the last coefficient
    got += [resumed(info_for(2, step=i), _entropy_batch(h)) for i, h in enumerate(hs[3:], start=3)]
    assert got == ref


def test_target_entropy_reads_only_valid_tokens_and_needs_the_extra():
    s = build("schedule", "target_entropy", gate=False)
    mb = _entropy_batch(0.3, garbage=float("nan"))  # mean over the 3 valid tokens: 0.3 ≥ 0.2 → falls
    mb.extras["entropy"][0, 0, 0] = float("inf")  # a non-finite value is ignored too
    assert s(info_for(2), mb) == 0.0
    mb.group_valid[:] = False  # no valid token: unchanged
    assert s(info_for(2), mb) == s.start()
    with pytest.raises(ValueError, match="Need\\('entropy'\\)"):
        s(info_for(2), rollout_from(torch.zeros(1, 1, 1), torch.zeros(1, 1)))


def test_target_entropy_drives_the_entropy_bonus_coefficient():
    term = build("objective", "entropy_bonus", coef={"schedule": "target_entropy", "init": 1e-3})
    assert term.coef == 1e-3 and "coef" in term.schedules
    values = schedules.resolve([term], info_for(2), _entropy_batch(0.1))  # H below target → 1e-3 + 1e-4
    assert term.coef == pytest.approx(1.1e-3) and values == {"coef/entropy_bonus.coef": pytest.approx(1.1e-3)}
