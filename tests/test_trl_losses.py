"""The objective terms a TRL user reaches for: CISPO, SAPO, GMPO, LUSPO, VESPO.

Hand-worked numbers first (conventions of tests/test_losses.py: ``d = logp - logp_old`` per token,
``ratio = e^d``; gradients are d(Σ loss)/d(logp) per token unless an aggregation is named), then
parity with TRL 1.16: TRL's own ``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py) is
called on a stand-in ``self`` with the same logp / old logp / advantages / mask, and its per-token
loss, aggregated loss and gradient are compared with ours. GMPO is not in TRL: its parity test
re-derives verl's ``compute_policy_loss_geo_mean`` (verl/trainer/ppo/core_algos.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers import info_for, leaf, make_logp, make_rollout, objective_for, rollout_from

from groupwise.registry import build

E05, E01, EM05 = math.exp(0.5), math.exp(0.1), math.exp(-0.5)  # 1.648721, 1.105171, 0.606531
NAN = float("nan")


def _term_grad(term, mb, logp):
    values = term(mb, {"logp": logp}, info_for(mb.shape[2]))
    m = mb.row_mask if values.dim() == 3 else mb.row_mask.any(-1)
    (grad,) = torch.autograd.grad(values[m].sum(), logp)
    return values.detach(), grad


def _agg_loss_grad(term, mb, logp, agg):
    obj = objective_for([term], agg)
    T = mb.shape[2]
    loss = obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(T)), info_for(T))
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, obj


def _rows(d, adv, logp=-1.0):
    """One token per row: logp = ``logp``, logp_old = logp − d, so ratio = e^d exactly as written."""
    d = torch.tensor(d).view(1, -1, 1)
    logp_t = torch.full_like(d, logp)
    return rollout_from(logp_t - d, torch.tensor([adv])), leaf(logp_t)


# ---------------------------------------------------------------------------------------------- cispo
def test_cispo_by_hand():
    # logp = −1 on every row, so loss = −w·A·(−1) = w·A and d loss/d logp = −w·A; eps_max = 1.2
    mb, logp = _rows([0.5, -0.5, 0.5, 2.0], [1.0, -1.0, -1.0, 1.0])
    term = build("objective", "cispo", eps_max=1.2)
    values, grad = _term_grad(term, mb, logp)
    # row 0: ratio 1.6487 > 1.2 → w 1.2, A=+1 → loss 1.2, grad −1.2 (capped weight, gradient kept)
    # row 1: ratio 0.6065 (no lower bound) → w 0.6065, A=−1 → loss −0.6065, grad +0.6065
    # row 2: ratio 1.6487 → w 1.2, A=−1 → loss −1.2, grad +1.2 (PPO keeps this token unclipped with
    #        weight 1.6487; CISPO caps the weight whatever the advantage's sign)
    # row 3: ratio e^2 = 7.389 → w 1.2, A=+1 → loss 1.2, grad −1.2 (PPO: 0)
    torch.testing.assert_close(values.flatten(), torch.tensor([1.2, -EM05, -1.2, 1.2]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([-1.2, EM05, 1.2, -1.2]))
    stats = term.stats(mb, {"logp": logp})
    # TRL's cispo_clip_ratio counts ratio > eps_max only where A > 0: rows 0, 3 (row 2 has A<0)
    assert stats["clip_high"].flatten().tolist() == [1, 0, 0, 1]
    assert stats["clip_low"].sum() == 0


def test_cispo_defaults_floor_and_on_policy():
    # default eps_max = 5: ratio e^2 = 7.389 → w = 5; ratio 1 (on-policy) → w = 1, grad −A exactly
    mb, logp = _rows([2.0, 0.0], [1.0, 1.0])
    values, grad = _term_grad(build("objective", "cispo"), mb, logp)
    torch.testing.assert_close(values.flatten(), torch.tensor([5.0, 1.0]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([-5.0, -1.0]))
    # eps_min = 0.8: ratio 0.6065 → w 0.8; A=−1 → loss −0.8, grad +0.8; counted as clip_low (A<0)
    mb, logp = _rows([-0.5], [-1.0])
    term = build("objective", "cispo", eps_min=0.8)
    values, grad = _term_grad(term, mb, logp)
    assert values.item() == pytest.approx(-0.8) and grad.item() == pytest.approx(0.8)
    assert term.stats(mb, {"logp": logp})["clip_low"].item() == 1


def test_cispo_ratio_exactly_on_cap():
    r = float(torch.exp(torch.tensor(0.1)))  # float32 e^0.1 = 1.105171
    mb, logp = _rows([0.1], [1.0])
    term = build("objective", "cispo", eps_max=r)
    values, grad = _term_grad(term, mb, logp)
    # w = ratio = eps_max → loss r·A = 1.105171, grad −r; on the cap ≠ clipped
    assert values.item() == pytest.approx(r, rel=1e-6) and grad.item() == pytest.approx(-r, rel=1e-6)
    assert term.stats(mb, {"logp": logp})["clip_high"].item() == 0


def test_cispo_garbage_padding_and_token_mean():
    # one row, tokens d = [0.5, −0.5, (masked: logp_old NaN, A NaN, logp 1e4)], A_t = [+1, −1]
    mb = rollout_from(
        torch.tensor([[[-1.5, -0.5, NAN]]]), torch.tensor([[[1.0, -1.0, NAN]]]), mask=torch.tensor([[[1, 1, 0]]])
    )
    logp = leaf([[[-1.0, -1.0, 1e4]]])
    term = build("objective", "cispo", eps_max=1.2)
    values = term(mb, {"logp": logp}, info_for(3))
    assert torch.isfinite(values).all()
    torch.testing.assert_close(values[0, 0, :2], torch.tensor([1.2, -EM05]))
    loss, grad, _ = _agg_loss_grad(term, mb, logp, "token_mean")
    # token mean over 2 tokens: (1.2 − 0.6065)/2 = 0.296735; grads [−1.2, +0.6065]/2, masked 0
    torch.testing.assert_close(loss, torch.tensor((1.2 - EM05) / 2))
    torch.testing.assert_close(grad[0, 0], torch.tensor([-0.6, EM05 / 2, 0.0]))


def _two_tokens(d, adv):
    """One row of 2 tokens: logp = (−1, −2), logp_old = logp − d."""
    logp = torch.tensor([[[-1.0, -2.0]]])
    return rollout_from(logp - torch.tensor(d), torch.tensor([[adv]])), leaf(logp)


def test_cispo_sequence_level_by_hand():
    # d = (0.2, −0.1): token ratios (1.221403, 0.904837); sequence ratio s = e^{0.05} = 1.051271
    # eps_max = 1.03: sequence level w = min(s, 1.03) = 1.03 on both tokens → loss −w·A·logp = (1.03, 2.06), grad −1.03
    #                 token level w = (1.03, 0.904837) → loss (1.03, 1.809675)
    mb, logp = _two_tokens([0.2, -0.1], 1.0)
    term = build("objective", "cispo", eps_max=1.03, level="sequence")
    values, grad = _term_grad(term, mb, logp)
    torch.testing.assert_close(values[0, 0], torch.tensor([1.03, 2.06]))
    torch.testing.assert_close(grad[0, 0], torch.tensor([-1.03, -1.03]))
    values, _ = _term_grad(build("objective", "cispo", eps_max=1.03), *_two_tokens([0.2, -0.1], 1.0))
    torch.testing.assert_close(values[0, 0], torch.tensor([1.03, 2 * 0.904837]))
    assert term.stats(mb, {"logp": logp})["clip_high"].tolist() == [[1.0]]  # one value per row, as TRL
    with pytest.raises(ValueError, match="cispo: level"):
        build("objective", "cispo", level="seq")


def test_sapo_sequence_level_by_hand():
    # d = (0.2, −0.1), s = 1.051271 on both tokens (gradient through the mean: ∂s/∂logp_t = s/2)
    # A = +1, τ = 1: σ(0.051271) = 0.512815, gate 4σ = 2.051260 → loss −2.051260 per token;
    #   d(Σ_t loss)/d logp_t = −2·4σ(1−σ)·s/2 = −1.050581
    # A = −1, τ = 1.05: σ(1.05·0.051271) = 0.513455, gate 4σ/1.05 = 1.956021 → loss +1.956021; grad +1.050510
    for adv, loss, g in ((1.0, -2.051260, -1.050581), (-1.0, 1.956021, 1.050510)):
        values, grad = _term_grad(build("objective", "sapo", level="sequence"), *_two_tokens([0.2, -0.1], adv))
        torch.testing.assert_close(values[0, 0], torch.tensor([loss, loss]))
        torch.testing.assert_close(grad[0, 0], torch.tensor([g, g]))
    with pytest.raises(ValueError, match="sapo: level"):
        build("objective", "sapo", level="seq")


def test_luspo_delta_by_hand():
    # d = (0.5, 0.5): s = e^{0.5} = 1.648721; eps 0.2; δ = 1.5
    # A = −1: −min(min(s, δ)·A, clip(s)·A) = −min(−1.5, −1.2) = 1.5 per token, no gradient (capped;
    #         without δ: s per token, gradient 2·s/2 = s)
    # A = +1: −min(1.5, 1.2) = −1.2 per token: the clip binds first, no gradient either way
    # d = (0.1, 0.1), A = −1: s = 1.105171 < δ: loss s per token, d(Σ_t)/d logp_t = 2·s/2 = 1.105171 (δ inactive)
    term = build("objective", "luspo", eps_low=0.2, eps_high=0.2, delta=1.5)
    for d, adv, loss, g in (([0.5, 0.5], -1.0, 1.5, 0.0), ([0.5, 0.5], 1.0, -1.2, 0.0), ([0.1, 0.1], -1.0, E01, E01)):
        values, grad = _term_grad(term, *_two_tokens(d, adv))
        torch.testing.assert_close(values[0, 0], torch.tensor([loss, loss]))
        torch.testing.assert_close(grad[0, 0], torch.tensor([g, g]))
    values, grad = _term_grad(build("objective", "luspo", eps_low=0.2, eps_high=0.2), *_two_tokens([0.5, 0.5], -1.0))
    torch.testing.assert_close(values[0, 0], torch.tensor([E05, E05]))  # without δ the exploded ratio's loss grows
    torch.testing.assert_close(grad[0, 0], torch.tensor([E05, E05]))
    mb, logp = _two_tokens([0.5, 0.5], -1.0)
    assert term.stats(mb, {"logp": logp})["clip_delta"].tolist() == [[1.0]]
    with pytest.raises(ValueError, match="luspo: delta"):
        build("objective", "luspo", delta=0.9)


@pytest.mark.parametrize("kw", [{"eps_max": 0.0}, {"eps_max": -1.0}, {"eps_min": -0.1}, {"eps_min": 5.0}])
def test_cispo_rejects_bad_bounds(kw):
    with pytest.raises(ValueError, match="cispo: eps_m"):
        build("objective", "cispo", **kw)


# ---------------------------------------------------------------------------------------------- sapo
def test_sapo_by_hand():
    mb, logp = _rows([0.0, 0.0, 0.5, -0.5, 0.0], [1.0, -1.0, 1.0, -1.0, 0.0])
    values, grad = _term_grad(build("objective", "sapo"), mb, logp)
    # gate = σ(τ(r−1))·4/τ, loss = −gate·A, grad = −A·r·4σ(1−σ); τ = 1 (A>0), 1.05 (A≤0)
    # row 0: r=1, τ=1: gate σ(0)·4 = 2 → loss −2; grad −1·1·4·0.25 = −1 (REINFORCE)
    # row 1: r=1, τ=1.05: gate 2/1.05 = 1.904762 → loss +1.904762; grad +1
    # row 2: r=1.648721, τ=1: σ(0.648721) = 0.656722 → gate 2.626889 → loss −2.626889;
    #        grad −1.648721·4·0.656722·0.343278 = −1.486739
    # row 3: r=0.606531, τ=1.05: σ(1.05·(−0.393469)) = σ(−0.413143) = 0.398159 → gate 4·0.398159/1.05
    #        = 1.516795 → loss +1.516795; grad +0.606531·4·0.398159·0.601841 = +0.581368
    # row 4: A = 0 → loss 0, grad 0
    torch.testing.assert_close(values.flatten(), torch.tensor([-2.0, 2 / 1.05, -2.626889, 1.516795, 0.0]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([-1.0, 1.0, -1.486739, 0.581368, 0.0]))


def test_sapo_soft_decay_instead_of_hard_clip():
    # d = 2: r = 7.389056, σ(6.389056) = 0.998323, 1 − σ = 0.001677 → grad −r·4σ(1−σ) = −0.049483:
    # decayed smoothly towards 0 (PPO: exactly 0 past 1.2; in float32 σ saturates to 1 beyond d ≈ 2.9)
    mb, logp = _rows([2.0, 0.15, 0.25], [1.0, 1.0, 1.0])
    values, grad = _term_grad(build("objective", "sapo"), mb, logp)
    assert grad[0, 0, 0].item() == pytest.approx(-0.049483, rel=1e-3)
    # the gradient is continuous across PPO's clip edge 1.2 (d = 0.1823): d = 0.15 → r = 1.161834,
    # σ(0.161834) = 0.540371 → −r·4σ(1−σ) = −1.154260; d = 0.25 → −1.258474 (PPO: −1.1618, then 0)
    torch.testing.assert_close(grad.flatten()[1:], torch.tensor([-1.154260, -1.258474]), rtol=1e-5, atol=1e-6)
    stats = build("objective", "sapo").stats(mb, {"logp": logp})
    assert stats["gate_slope"][0, 0, 0].item() == pytest.approx(0.049483 / math.exp(2), rel=1e-3)
    assert 0.9 < stats["gate_slope"][0, 1, 0].item() < 1


def test_sapo_garbage_padding_and_seq_mean():
    # row 0: tokens [d=0 A=+1, masked garbage], row 1: one token d=0 A=−1 → per-token −2 and +1.904762
    mb = rollout_from(
        torch.tensor([[[-1.0, 1e4], [-1.0, 0.0]]]), torch.tensor([[1.0, -1.0]]), mask=torch.tensor([[[1, 0], [1, 0]]])
    )
    logp = leaf([[[-1.0, -1e4], [-1.0, NAN]]])
    values = build("objective", "sapo")(mb, {"logp": logp}, info_for(2))
    assert torch.isfinite(values).all()
    loss, grad, _ = _agg_loss_grad(build("objective", "sapo"), mb, logp, "seq_mean_token_mean")
    # (−2 + 1.904762)/2 = −0.047619; grads −1/2, +1/2 on the real tokens, 0 on padding
    torch.testing.assert_close(loss, torch.tensor((-2 + 2 / 1.05) / 2))
    torch.testing.assert_close(grad, torch.tensor([[[-0.5, 0.0], [0.5, 0.0]]]))


@pytest.mark.parametrize("kw", [{"tau_pos": 0.0}, {"tau_neg": -1.0}])
def test_sapo_rejects_nonpositive_temperature(kw):
    with pytest.raises(ValueError, match="sapo: tau_"):
        build("objective", "sapo", **kw)


# ---------------------------------------------------------------------------------------------- gmpo
def _gmpo_row(d, adv, mask=None):
    d = torch.tensor(d).view(1, 1, -1)
    return rollout_from(torch.zeros_like(d), torch.tensor([[adv]]), mask=mask), leaf(d)


def test_gmpo_by_hand_positive_and_negative():
    term = build("objective", "gmpo")  # eps 0.4 / 0.4 in log space
    # A=+1, d = [0.2, 0.6, −0.5]: cap above only → d_clip = [0.2, 0.4, −0.5], mean 0.1/3
    # ratio e^0.033333 = 1.033895, loss −1.033895; grad −A·ratio/3 = −0.344632 on tokens 0, 2; token 1 clipped → 0
    mb, logp = _gmpo_row([0.2, 0.6, -0.5], 1.0)
    values, grad = _term_grad(term, mb, logp)
    assert values.shape == (1, 1) and values.item() == pytest.approx(-1.033895, rel=1e-6)
    torch.testing.assert_close(grad[0, 0], torch.tensor([-0.344632, 0.0, -0.344632]))
    st = term.stats(mb, {"logp": logp})
    assert st["clip_high"][0, 0].tolist() == [0, 1, 0] and st["clip_low"].sum() == 0
    assert st["ratio"].item() == pytest.approx(math.exp(0.3 / 3), rel=1e-6)  # unclipped geometric mean
    # A=−1, same d: floor below only → d_clip = [0.2, 0.6, −0.4], mean 0.4/3
    # ratio e^0.133333 = 1.142631, loss +1.142631; grad +ratio/3 = 0.380877 on tokens 0, 1; token 2 → 0
    mb, logp = _gmpo_row([0.2, 0.6, -0.5], -1.0)
    values, grad = _term_grad(term, mb, logp)
    assert values.item() == pytest.approx(1.142631, rel=1e-6)
    torch.testing.assert_close(grad[0, 0], torch.tensor([0.380877, 0.380877, 0.0]))
    assert term.stats(mb, {"logp": logp})["clip_low"][0, 0].tolist() == [0, 0, 1]


def test_gmpo_log_ratio_exactly_on_bound():
    # d = 0.4 (float32) = eps_high → d_clip = 0.4, ratio e^0.4 = 1.491825, full gradient −ratio (one token)
    mb, logp = _gmpo_row([0.4], 1.0)
    term = build("objective", "gmpo")
    values, grad = _term_grad(term, mb, logp)
    r = float(torch.exp(torch.tensor(0.4)))
    assert values.item() == pytest.approx(-r, rel=1e-6) and grad.item() == pytest.approx(-r, rel=1e-6)
    assert term.stats(mb, {"logp": logp})["clip_high"].item() == 0
    _, grad_out = _term_grad(term, *_gmpo_row([0.4001], 1.0))
    assert grad_out.item() == 0.0  # just past the bound: clipped


def test_gmpo_masked_garbage_token_adv_and_seq_mean():
    # row 0: tokens d = [0.1, 0.3, (masked 50)], A_t = [2, 0, (NaN)] → adv_s = 1, d_clip = [0.1, 0 (sgn 0), -]
    #   ratio = e^{0.05} = 1.051271, loss −1.051271
    # row 1: one token d = −0.2, A = −1 → d_clip = −0.2, ratio e^−0.2 = 0.818731, loss +0.818731
    logp_old = torch.tensor([[[0.0, 0.0, NAN], [0.0, 0.0, 0.0]]])
    adv = torch.tensor([[[2.0, 0.0, NAN], [-1.0, -1.0, -1.0]]])
    mb = rollout_from(logp_old, adv, mask=torch.tensor([[[1, 1, 0], [1, 0, 0]]]))
    logp = leaf([[[0.1, 0.3, 50.0], [-0.2, 7.0, NAN]]])
    term = build("objective", "gmpo")
    values = term(mb, {"logp": logp}, info_for(3))
    torch.testing.assert_close(values, torch.tensor([[-math.exp(0.05), math.exp(-0.2)]]))
    loss, grad, _ = _agg_loss_grad(term, mb, logp, "seq_mean_token_mean")
    # mean over the 2 rows = (−1.051271 + 0.818731)/2 = −0.116270
    # grads: row 0 token 0: −adv_s·ratio/2 tokens/2 rows = −0.262818; token 1 has sgn 0 → 0 (verl)
    #        row 1 token 0: +0.818731/1/2 = 0.409365; padding 0
    torch.testing.assert_close(loss, torch.tensor((-math.exp(0.05) + math.exp(-0.2)) / 2))
    torch.testing.assert_close(grad, torch.tensor([[[-math.exp(0.05) / 4, 0.0, 0.0], [math.exp(-0.2) / 2, 0.0, 0.0]]]))


def _verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high, rollout_is_weights=None):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_geo_mean, re-derived step by step (with its
    sequence geometric mean of ``rollout_is_weights``, floored at 1e-10 inside the log)."""
    neg_kl = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    neg_kl_clamp = torch.clamp(neg_kl, -clip_low, clip_high)
    neg_kl_min = sgn * torch.min(sgn * neg_kl, sgn * neg_kl_clamp)
    n = response_mask.sum(-1)
    ratio = torch.exp((neg_kl_min * response_mask).sum(-1) / (n + 1e-8))
    advantage = (advantages * response_mask).sum(-1) / (n + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        pg_losses = pg_losses * torch.exp((torch.log(rollout_is_weights + 1e-10) * response_mask).sum(-1) / (n + 1e-8))
    return pg_losses, torch.mean(pg_losses)


@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.1, 0.2)])
def test_gmpo_verl_parity(eps):
    ro = make_rollout(3, 4, 6, seed=31, awkward=False, garbage=0.0)  # verl sees clean padding
    logp = make_logp(ro, seed=32, scale=0.4)
    term = build("objective", "gmpo", eps_low=eps[0], eps_high=eps[1])
    loss, grad, _ = _agg_loss_grad(term, ro, logp, "seq_mean_token_mean")
    m = ro.mask.float().view(12, 6)
    adv = (ro.advantages[..., None] * torch.ones(1, 1, 6)).view(12, 6)  # verl's broadcast [bs, T] advantages
    pg, ref = _verl_geo_mean(ro.logp_old.view(12, 6), logp.view(12, 6), adv, m, *eps)
    (grad_ref,) = torch.autograd.grad(ref, logp)
    values = term(ro, {"logp": logp}, info_for(6)).detach()
    diffs = [(values.flatten() - pg.detach()).abs().max(), (loss - ref.detach()).abs(), (grad - grad_ref).abs().max()]
    print(f"gmpo vs verl geo_mean eps={eps}: max |Δ| per-seq {diffs[0]:.2e}, loss {diffs[1]:.2e}, grad {diffs[2]:.2e}")
    assert max(diffs) < 1e-6


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_gmpo_token_weights_verl_parity(mode):
    # verl's geo_mean with rollout_is_weights (its rollout correction: truncated IS, threshold 2) against
    # gmpo + the sampler_is weight: the row factor is the sequence geometric mean of the weights.
    from groupwise.objective import token_weights

    ro = make_rollout(3, 4, 6, seed=33, awkward=False, garbage=0.0)
    logp = make_logp(ro, seed=34, scale=0.3)
    ro.logp_sampler = ro.logp_old - 0.5 * torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(35))
    ro.weight, counted = token_weights([build("weight", "sampler_is", mode=mode, hi=2.0)], ro, info_for(6))
    ro.set_extra("counted", counted, "token")
    loss, grad, _ = _agg_loss_grad(build("objective", "gmpo"), ro, logp, "seq_mean_token_mean")
    m = ro.mask.float().view(12, 6)
    adv = (ro.advantages[..., None] * torch.ones(1, 1, 6)).view(12, 6)
    pg, ref = _verl_geo_mean(ro.logp_old.view(12, 6), logp.view(12, 6), adv, m, 0.4, 0.4, ro.weight.view(12, 6))
    (grad_ref,) = torch.autograd.grad(ref, logp)
    _, unweighted = _verl_geo_mean(ro.logp_old.view(12, 6), logp.detach().view(12, 6), adv, m, 0.4, 0.4)
    d_loss, d_grad = (loss - ref.detach()).abs().item(), (grad - grad_ref).abs().max().item()
    print(
        f"gmpo + sampler_is({mode}) vs verl geo_mean with rollout_is_weights: max |Δ| loss {d_loss:.2e}, "
        f"grad {d_grad:.2e}"
    )
    assert d_loss < 1e-6 and d_grad < 1e-6
    assert abs(ref.item() - unweighted.item()) > 1e-3  # the weights move verl's loss: the comparison is not vacuous


@pytest.mark.parametrize("kw", [{"eps_low": -0.1}, {"eps_high": -0.1}])
def test_gmpo_rejects_negative_bounds(kw):
    with pytest.raises(ValueError, match="gmpo"):
        build("objective", "gmpo", **kw)


# ---------------------------------------------------------------------------------------------- luspo
def test_luspo_by_hand():
    # one row, d = [0.2, −0.1, (masked 5.0)] → log_s = 0.05, s = e^0.05 = 1.051271, |y| = 2
    mb = rollout_from(torch.zeros(1, 2, 3), torch.tensor([[1.0, -1.0]]), mask=torch.tensor([[[1, 1, 0], [1, 1, 0]]]))
    logp = leaf([[[0.2, -0.1, 5.0], [0.2, -0.1, 5.0]]])
    s = math.exp(0.05)
    wide = build("objective", "luspo", eps_low=0.2, eps_high=0.2)
    values, grad = _term_grad(wide, mb, logp)
    # A=+1 unclipped: l_t = −s on both tokens (row sum −2.102542); d/d logp_t = −A·s·(1/|y|)·|y| = −1.051271
    # A=−1: −min(−s, −clip(s)) = s → +1.051271 per token (row +2.102542); grad +1.051271; padding 0
    torch.testing.assert_close(values, torch.tensor([[[-s, -s, 0.0], [s, s, 0.0]]]))
    torch.testing.assert_close(grad, torch.tensor([[[-s, -s, 0.0], [s, s, 0.0]]]))
    # defaults (3e-4, 4e-4): A=+1 → s > 1.0004 → clipped: −1.0004 per token (row −2.0008), no gradient;
    # A=−1 → min(−s, −1.0004) = −s unclipped (pessimistic side) → s per token, grad +s
    values, grad = _term_grad(build("objective", "luspo"), mb, logp)
    torch.testing.assert_close(values, torch.tensor([[[-1.0004, -1.0004, 0.0], [s, s, 0.0]]]))
    torch.testing.assert_close(grad, torch.tensor([[[0.0, 0.0, 0.0], [s, s, 0.0]]]))
    st = build("objective", "luspo").stats(mb, {"logp": logp})
    assert st["clip_high"].tolist() == [[1.0, 0.0]] and st["clip_low"].tolist() == [[0.0, 0.0]]


def test_luspo_is_length_times_gspo_and_sum_over_rows():
    # rows of lengths 3 and 1: LUSPO batch loss = (3·l_0 + 1·l_1)/2 rows, GSPO's = (l_0 + l_1)/2
    ro = make_rollout(1, 2, 3, seed=4, awkward=False)
    ro.mask = torch.tensor([[[1, 1, 1], [1, 0, 0]]], dtype=torch.bool)
    logp = make_logp(ro, seed=5, scale=0.02)
    kw = dict(eps_low=0.2, eps_high=0.2)
    row = build("objective", "luspo", **kw)(ro, {"logp": logp}, info_for(3)).sum(-1)  # [1,2] Σ_t over the mask
    gspo = build("objective", "gspo", **kw)(ro, {"logp": logp}, info_for(3))[..., 0]  # [1,2] per-row loss
    torch.testing.assert_close(row, gspo * torch.tensor([[3.0, 1.0]]))
    loss, _, _ = _agg_loss_grad(build("objective", "luspo", **kw), ro, logp, "token_mean")  # term agg wins
    torch.testing.assert_close(loss, (3 * gspo[0, 0] + gspo[0, 1]).detach() / 2)


def test_luspo_token_level_and_boundary():
    # level="token": row = Σ_t ppo_clip(token): d = [0.5, 0.1], A=+1 → −1.2 − e^0.1 = −2.305171
    mb = rollout_from(torch.zeros(1, 1, 2), torch.tensor([[1.0]]))
    values, grad = _term_grad(
        build("objective", "luspo", eps_low=0.2, eps_high=0.2, level="token"), mb, leaf([[[0.5, 0.1]]])
    )
    torch.testing.assert_close(values[0, 0], torch.tensor([-1.2, -E01]))
    torch.testing.assert_close(grad[0, 0], torch.tensor([0.0, -E01]))
    # sequence ratio exactly 1 + eps_high: one token d = 0.1, eps_high = e^0.1 − 1 (float32) → full gradient −s
    r = float(torch.exp(torch.tensor(0.1)))
    term = build("objective", "luspo", eps_low=0.2, eps_high=r - 1.0)
    mb = rollout_from(torch.zeros(1, 1, 1), torch.tensor([[1.0]]))
    values, grad = _term_grad(term, mb, leaf([[[0.1]]]))
    assert values.item() == pytest.approx(-r, rel=1e-6) and grad.item() == pytest.approx(-r, rel=1e-6)
    assert term.stats(mb, {"logp": leaf([[[0.1]]])})["clip_high"].item() == 0


def test_luspo_on_policy_gradient_is_the_token_sum():
    # on-policy, A_i = 1: d/d logp_t of Σ_i |y_i| l_i / rows = −A·1·(1/|y|)·|y| / rows = −1/2 per token
    mb = rollout_from(
        torch.tensor([[[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]]]),
        torch.tensor([[1.0, 1.0]]),
        mask=torch.tensor([[[1, 1, 1], [1, 0, 0]]]),
    )
    logp = leaf(mb.logp_old)
    loss, grad, _ = _agg_loss_grad(build("objective", "luspo"), mb, logp, "seq_mean_token_mean")
    assert loss.item() == pytest.approx(-(3 + 1) / 2)  # −(3·1 + 1·1)/2
    torch.testing.assert_close(grad, torch.tensor([[[-0.5, -0.5, -0.5], [-0.5, 0.0, 0.0]]]))


def test_luspo_rejects_bad_level():
    with pytest.raises(ValueError, match="luspo: level"):
        build("objective", "luspo", level="seq")


# ---------------------------------------------------------------------------------------------- vespo
def test_vespo_by_hand():
    # row: d = [0.1, 0.2, (masked garbage)], logp = [−1, −2] → log_w = 0.3 (a sum, not a mean), w = 1.349859
    # A=+1 (k=2, λ=3): log φ = 3 + 2·0.3 − 3·1.349859 = −0.449576 → φ = 0.637898
    #   loss = −φ·A·logp = [0.637898, 1.275797]; grad = −φ·A = −0.637898 per token
    # A=−1 (k=3, λ=2): log φ = 2 + 0.9 − 2·1.349859 = 0.200282 → φ = 1.221748
    #   loss = [−1.221748, −2.443495]; grad = +1.221748
    logp_v = torch.tensor([[[-1.0, -2.0, 9.0], [-1.0, -2.0, 9.0]]])
    logp_old = logp_v - torch.tensor([0.1, 0.2, 0.0])
    logp_old[..., 2] = NAN
    mb = rollout_from(logp_old, torch.tensor([[1.0, -1.0]]), mask=torch.tensor([[[1, 1, 0], [1, 1, 0]]]))
    logp = leaf(logp_v)
    term = build("objective", "vespo")
    values, grad = _term_grad(term, mb, logp)
    p_pos, p_neg = 0.637898, 1.221748
    torch.testing.assert_close(
        values, torch.tensor([[[p_pos, 2 * p_pos, 0.0], [-p_neg, -2 * p_neg, 0.0]]]), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(grad, torch.tensor([[[-p_pos, -p_pos, 0.0], [p_neg, p_neg, 0.0]]]), rtol=1e-5, atol=1e-6)
    st = term.stats(mb, {"logp": logp})
    torch.testing.assert_close(st["log_w"], torch.tensor([[0.3, 0.3]]))


def test_vespo_on_policy_and_extremes():
    # on-policy: log_w = 0 → φ = e^{λ−λ} = 1 exactly: loss −A·logp = [1, −1] (logp = −1), grad −A
    mb, logp = _rows([0.0, 0.0], [1.0, -1.0])
    values, grad = _term_grad(build("objective", "vespo"), mb, logp)
    torch.testing.assert_close(values.flatten(), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(grad.flatten(), torch.tensor([-1.0, 1.0]))
    # d = 25 per token on 2 tokens: each clamped to 20, Σ = 40 → clamped to 20, w = e^20 → φ = 0 (no NaN)
    # d = −50: clamped −20 each, Σ −40 → clamped to log 1e-8 = −18.42 → φ = e^{3 − 36.84 − 3e-8} ≈ 2e-15
    mb = rollout_from(torch.tensor([[[-26.0, -26.0], [49.0, 49.0]]]), torch.tensor([[1.0, 1.0]]))
    logp = leaf(torch.full((1, 2, 2), -1.0))
    term = build("objective", "vespo")
    values, grad = _term_grad(term, mb, logp)
    assert torch.isfinite(values).all() and torch.isfinite(grad).all()
    assert (values[0, 0] == 0).all()
    phi_lo = math.exp(3 + 2 * math.log(1e-8) - 3e-8)  # 1.99e-15
    torch.testing.assert_close(grad[0, 1], torch.full((2,), -phi_lo), rtol=1e-4, atol=0)


def test_vespo_sampler_is_truncate_and_mask():
    # on-policy in θ (logp = logp_old), but the sampler differs: logp_old − logp_sampler = [2, 0]
    # token_truncate (max 3): is = [min(e^2, 3), 1] → log_w = log 3 = 1.098612, w = 3
    #   A=+1: log φ = 3 + 2·1.098612 − 9 = −3.802775 → φ = 0.022314; grad −φ
    # token_mask: e^2 = 7.389 > 3 → is 0 → log clamped to log 1e-8 → log_w = −18.4207 → φ ≈ 2e-15
    mb = rollout_from(
        torch.tensor([[[-1.0, -1.0]]]), torch.tensor([[1.0]]), logp_sampler=torch.tensor([[[-3.0, -1.0]]])
    )
    logp = leaf([[[-1.0, -1.0]]])
    _, grad = _term_grad(build("objective", "vespo", sampler_is="token_truncate"), mb, logp)
    torch.testing.assert_close(grad[0, 0], torch.full((2,), -math.exp(3 + 2 * math.log(3) - 9)))
    _, grad = _term_grad(build("objective", "vespo", sampler_is="token_mask"), mb, logp)
    assert 0 < -grad[0, 0, 0].item() < 1e-14
    with pytest.raises(ValueError, match="logp_sampler"):
        mb.logp_sampler = None
        build("objective", "vespo", sampler_is="token_mask")(mb, {"logp": logp}, info_for(2))


@pytest.mark.parametrize("kw", [{"sampler_is": "sequence_mask"}, {"k_pos": -1.0}, {"lambda_neg": -0.5}])
def test_vespo_rejects_bad_options(kw):
    with pytest.raises(ValueError, match="vespo"):
        build("objective", "vespo", **kw)


# ---------------------------------------------------------------------------------------------- TRL parity
class _Spy:
    """Stands in for TRL's off-policy mask: ``per_token_loss * spy`` records and returns the loss."""

    seen = None

    def __rmul__(self, other):
        self.seen = other
        return other


def _trl_compute_loss(
    loss_type,
    logp,
    logp_old,
    adv,
    mask,
    level="token",
    eps=(0.2, 0.2),
    is_ratio=None,
    entropy=None,
    top_entropy_quantile=1.0,
    **args,
):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py) on [N,T] tensors, via a
    stand-in ``self``: returns (per-token loss before masking, the returned loss, metrics). ``is_ratio``
    [N,T] or [N,1] turns vLLM IS correction on (``importance_sampling_ratio``); ``entropy`` [N,T] with
    ``top_entropy_quantile`` < 1 runs TRL's own ``get_high_entropy_mask`` on one process."""
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    spy = _Spy()
    config = dict(
        delta=None,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=1,
        use_bias_correction_kl=False,
    )
    config.update(args)
    metrics = defaultdict(lambda: defaultdict(list))
    entropies = torch.zeros_like(logp) if entropy is None else entropy  # [N,T]
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropies, None),
        top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=1.0,
        get_off_policy_mask=lambda **k: spy,
        importance_sampling_level=level,
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        args=SimpleNamespace(**config),
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=metrics,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        accelerator=SimpleNamespace(
            num_processes=1,
            reduce=lambda t, reduction="sum": t,
            gather=lambda t: t,
            pad_across_processes=lambda t, dim=0, pad_index=0: t,
        ),
    )
    fake.get_high_entropy_mask = lambda e, m, threshold: GRPOTrainer.get_high_entropy_mask(fake, e, m, threshold)
    N, T = logp.shape
    inputs = dict(
        prompt_ids=torch.zeros(N, 1, dtype=torch.long),
        prompt_mask=torch.ones(N, 1, dtype=torch.long),
        completion_ids=torch.zeros(N, T, dtype=torch.long),
        completion_mask=mask.long(),
        advantages=adv,
        old_per_token_logps=logp_old,
        num_items_in_batch=mask.sum().float(),
    )
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    return spy.seen, loss, metrics["train"]


# (name, our params, TRL loss_type, TRL level, TRL eps, our aggregation)
CASES = [
    ("cispo", {"eps_max": 5.0}, "cispo", "token", (0.2, 5.0), "token_mean"),
    ("cispo", {"eps_max": 1.1}, "cispo", "token", (0.2, 1.1), "token_mean"),
    ("sapo", {}, "sapo", "token", (0.2, 0.2), "seq_mean_token_mean"),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 3.0}, "sapo", "token", (0.2, 0.2), "seq_mean_token_mean"),
    ("luspo", {"eps_low": 0.03, "eps_high": 0.05}, "luspo", "sequence", (0.03, 0.05), None),
    ("luspo", {"eps_low": 0.2, "eps_high": 0.28, "level": "token"}, "luspo", "token", (0.2, 0.28), None),
    ("vespo", {}, "vespo", "token", (0.2, 0.2), "token_mean"),
    # TRL's importance_sampling_level="sequence" for cispo and sapo, and its two-sided clip `delta` on luspo
    ("cispo", {"eps_max": 5.0, "level": "sequence"}, "cispo", "sequence", (0.2, 5.0), "token_mean"),
    ("cispo", {"eps_max": 1.03, "level": "sequence"}, "cispo", "sequence", (0.2, 1.03), "token_mean"),
    ("sapo", {"level": "sequence"}, "sapo", "sequence", (0.2, 0.2), "seq_mean_token_mean"),
    (
        "sapo",
        {"tau_pos": 2.0, "tau_neg": 3.0, "level": "sequence"},
        "sapo",
        "sequence",
        (0.2, 0.2),
        "seq_mean_token_mean",
    ),
    ("luspo", {"eps_low": 0.03, "eps_high": 0.05, "delta": 1.06}, "luspo", "sequence", (0.03, 0.05), None),
    ("luspo", {"eps_low": 0.2, "eps_high": 0.28, "level": "token", "delta": 1.3}, "luspo", "token", (0.2, 0.28), None),
]


@pytest.mark.parametrize("token_adv", [False, True])
@pytest.mark.parametrize("name,params,loss_type,level,eps,agg", CASES)
def test_trl_parity(name, params, loss_type, level, eps, agg, token_adv):
    # every row valid with ≥ 1 token (TRL's grpo/luspo denominators count empty rows); finite garbage
    # (±30) in logp_old / token advantages on padding — TRL masks after its non-linearities.
    B, G, T = 3, 4, 7
    ro = make_rollout(B, G, T, seed=41, awkward=False, token_adv=token_adv)
    logp = make_logp(ro, seed=42, scale=0.25 if name != "vespo" else 0.08)
    term = build("objective", name, **params)
    tr_args = {"sapo_temperature_pos": term.tau_pos, "sapo_temperature_neg": term.tau_neg} if name == "sapo" else {}
    if "delta" in params:
        tr_args["delta"] = params["delta"]
    N = B * G
    adv = ro.advantages.reshape(N, T) if token_adv else ro.advantages.reshape(N)
    ptl, trl_loss, trl_metrics = _trl_compute_loss(
        loss_type, logp.reshape(N, T), ro.logp_old.reshape(N, T), adv, ro.mask.reshape(N, T), level, eps, **tr_args
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, logp, retain_graph=True)
    values = term(ro, {"logp": logp}, info_for(T)).detach()
    loss, grad, obj = _agg_loss_grad(term, ro, logp, agg or "seq_mean_token_mean")
    m = ro.mask.reshape(N, T)
    ptl = ptl.detach().expand(N, T)  # at sequence level TRL's [N,1] per-token loss, broadcast by its mask product
    d_tok = (values.reshape(N, T)[m] - ptl[m]).abs().max()
    d_loss, d_grad = (loss - trl_loss.detach()).abs(), (grad - trl_grad).abs().max()
    scale = max(1.0, trl_loss.abs().item())
    print(
        f"TRL parity {name} {params} token_adv={token_adv}: max |Δ| "
        f"per-token {d_tok:.2e}, loss {d_loss:.2e}, grad {d_grad:.2e}"
    )
    assert d_tok < 1e-5 * max(1.0, ptl[m].abs().max().item())
    assert d_loss < 1e-6 * scale and d_grad < 1e-6
    assert trl_grad.abs().sum() > 0  # the comparison is not vacuous
    if "delta" in params:  # the two-sided clip binds somewhere: the comparison reaches it
        assert term.stats(ro, {"logp": logp})["clip_delta"].sum() > 0
    if params.get("eps_max", 5.0) < 2.0 or (name == "luspo" and level == "sequence"):  # the caps and clips bind too
        assert term.stats(ro, {"logp": logp})["clip_high"].sum() > 0
    if name in ("cispo", "luspo"):  # clip statistics as TRL logs them
        obj.pop_stats()
        obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(T)), info_for(T))
        got = obj.pop_stats()
        key = {"cispo": ("clip_high", "cispo_clip_ratio"), "luspo": ("clip_high", "clip_ratio/high_mean")}[name]
        assert got[key[0]] == pytest.approx(trl_metrics[key[1]][-1], abs=1e-6)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_trl_parity_vespo_gamma_weights_with_sampler_is(mode):
    # TRL's static GRPOTrainer.get_gamma_weights (called directly) with TRL's token IS ratio from
    # _generate_and_score_completions (grpo_trainer.py): exp((old − sampler)·mask), clamp or zero
    # outside [min, max]; ours folds the same ratio into log_w.
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    B, G, T = 2, 4, 5
    ro = make_rollout(B, G, T, seed=51, awkward=False)
    logp = make_logp(ro, seed=52, scale=0.08)
    g = torch.Generator().manual_seed(53)
    ro.logp_sampler = ro.logp_old - 0.6 * torch.randn(B, G, T, generator=g)
    N, m = B * G, ro.mask.reshape(B * G, T)
    is_ratio = torch.exp((ro.logp_old - ro.logp_sampler).reshape(N, T) * m)
    if mode == "token_truncate":
        is_ratio = is_ratio.clamp(max=2.0)
    else:
        is_ratio = is_ratio.masked_fill(is_ratio > 2.0, 0.0)
    adv = ro.advantages.reshape(N, 1)
    # [N,1]
    phi_trl = GRPOTrainer.get_gamma_weights(adv, (logp - ro.logp_old).detach().reshape(N, T), m.float(), is_ratio)
    term = build("objective", "vespo", sampler_is=mode, is_max=2.0)
    phi = term.stats(ro, {"logp": logp})["phi"].reshape(N, T)
    diff = (phi[m] - phi_trl.expand(N, T)[m]).abs().max()
    print(
        f"TRL parity vespo phi sampler_is={mode}: max |Δ| {diff:.2e} "
        f"(phi range {phi_trl.min():.3g}..{phi_trl.max():.3g})"
    )
    assert diff < 1e-6 * max(1.0, phi_trl.abs().max().item())
    assert (phi_trl - 1).abs().max() > 0.1  # the IS ratio moved the weights
    if mode == "token_mask":
        assert (phi_trl < 1e-6).any()  # a zeroed IS ratio → log 1e-8 → φ ≈ 0


def test_trl_delta_is_ppo_clip_dual_clip():
    # TRL's `delta` (two-sided GRPO, INTELLECT-2) clamps the ratio at δ before the min: for A < 0 and
    # ratio > δ, min(δ·A, (1+ε)·A) = δ·A, our dual clip c = δ; for A > 0 the clip at 1+ε < δ binds first.
    B, G, T = 3, 4, 7
    ro = make_rollout(B, G, T, seed=41, awkward=False)
    logp = make_logp(ro, seed=42, scale=0.6)
    ratio = (logp.detach() - ro.logp_old).exp()  # [B,G,T]
    hit = (ratio > 1.3) & (ro.advantages[..., None] < 0) & ro.row_mask  # tokens the dual clip bounds
    assert hit.sum() >= 3, "the comparison must reach the dual clip"
    N = B * G
    _, trl_loss, _ = _trl_compute_loss(
        "grpo",
        logp.reshape(N, T),
        ro.logp_old.reshape(N, T),
        ro.advantages.reshape(N),
        ro.mask.reshape(N, T),
        delta=1.3,
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, logp, retain_graph=True)
    loss, grad, _ = _agg_loss_grad(build("objective", "ppo_clip", dual_clip=1.3), ro, logp, "seq_mean_token_mean")
    print(
        "TRL parity ppo_clip dual_clip=1.3 vs delta=1.3: loss "
        f"{abs(loss - trl_loss.detach()):.2e}, grad {(grad - trl_grad).abs().max():.2e}"
    )
    assert abs(loss - trl_loss.detach()) < 1e-6 and (grad - trl_grad).abs().max() < 1e-6
    undual, _, _ = _agg_loss_grad(build("objective", "ppo_clip"), ro, logp, "seq_mean_token_mean")
    assert abs(undual - loss) > 1e-4  # without the dual clip the loss differs: the test can fail


@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_parity_luspo_with_sampler_is(mode, level):
    # TRL multiplies luspo's per_token_loss by its vLLM IS ratio (from _generate_and_score_completions,
    # re-derived in tests/test_sampler_is.py) before the row sums; ours: the sampler_is weight per token.
    from test_sampler_is import _trl_is_ratio

    from groupwise.objective import token_weights

    B, G, T = 3, 4, 7
    ro = make_rollout(B, G, T, seed=61, awkward=False)
    logp = make_logp(ro, seed=62, scale=0.15)
    ro.logp_sampler = ro.logp_old - 0.4 * torch.randn(B, G, T, generator=torch.Generator().manual_seed(63))
    N, m = B * G, ro.mask.reshape(B * G, T)
    lo, hi = 0.5, 2.0
    is_ratio = _trl_is_ratio(ro.logp_old.reshape(N, T), ro.logp_sampler.reshape(N, T), m.float(), mode, lo, hi)
    eps = (0.2, 0.28)
    old, adv = ro.logp_old.reshape(N, T), ro.advantages.reshape(N)
    _, trl_loss, _ = _trl_compute_loss("luspo", logp.reshape(N, T), old, adv, m, level, eps, is_ratio)
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    ro.weight, counted = token_weights([build("weight", "sampler_is", mode=mode, lo=lo, hi=hi)], ro, info_for(T))
    ro.set_extra("counted", counted, "token")
    term = build("objective", "luspo", eps_low=eps[0], eps_high=eps[1], level=level)
    loss, grad, _ = _agg_loss_grad(term, ro, logp, "seq_mean_token_mean")
    d_loss, d_grad = abs(loss.item() - trl_loss.item()), (grad - trl_grad).abs().max().item()
    print(
        f"TRL parity luspo level={level} + sampler_is {mode}: max |Δ| loss {d_loss:.2e}, grad {d_grad:.2e} "
        f"(loss {trl_loss.item():.4f})"
    )
    assert d_loss < 1e-6 * max(1.0, abs(trl_loss.item())) and d_grad < 1e-6
    ro.weight = None
    unweighted, _, _ = _agg_loss_grad(term, ro, logp, "seq_mean_token_mean")
    assert abs(unweighted.item() - trl_loss.item()) > 1e-2  # the IS ratio moves the loss (before the fix: ignored)


@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("rho", [0.2, 0.5])
def test_trl_parity_luspo_with_top_entropy(rho, level):
    # TRL's top_entropy_quantile = rho: its own get_high_entropy_mask (torch.quantile of the masked
    # entropies at 1 − rho) multiplies per_token_loss; ours: top_entropy(rho), scope "loss".
    from groupwise.objective import token_weights

    B, G, T = 3, 4, 7
    ro = make_rollout(B, G, T, seed=71, awkward=False)
    logp = make_logp(ro, seed=72, scale=0.15)
    entropy = 2.0 * torch.rand(B, G, T, generator=torch.Generator().manual_seed(73))  # [B,G,T] distinct values: no ties
    ro.set_extra("entropy", entropy, "token")
    N, m = B * G, ro.mask.reshape(B * G, T)
    eps = (0.2, 0.28)
    old, adv = ro.logp_old.reshape(N, T), ro.advantages.reshape(N)
    _, trl_loss, _ = _trl_compute_loss(
        "luspo", logp.reshape(N, T), old, adv, m, level, eps, entropy=entropy.reshape(N, T), top_entropy_quantile=rho
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    ro.weight, counted = token_weights([build("weight", "top_entropy", rho=rho)], ro, info_for(T))
    ro.set_extra("counted", counted, "token")
    term = build("objective", "luspo", eps_low=eps[0], eps_high=eps[1], level=level)
    loss, grad, _ = _agg_loss_grad(term, ro, logp, "seq_mean_token_mean")
    d_loss, d_grad = abs(loss.item() - trl_loss.item()), (grad - trl_grad).abs().max().item()
    kept = int((ro.weight > 0).sum())
    print(
        f"TRL parity luspo level={level} + top_entropy rho={rho}: max |Δ| loss {d_loss:.2e}, grad {d_grad:.2e} "
        f"({kept} of {int(m.sum())} tokens kept)"
    )
    assert d_loss < 1e-6 * max(1.0, abs(trl_loss.item())) and d_grad < 1e-6
    assert 0 < kept < int(m.sum())
