"""μ-GRPO's veto and relaxed clip (specs/06), worked by hand.

Spec example: one row, behaviour probs all 0.5, current probs [0.6, 0.4, 1e-5, 0.45, 0.5] →
ratio = [1.2, 0.8, 2e-5, 0.9, 1.0]; the trigger (ratio < 1e-4) is t = 2. With A = −1::

    suffix            keep = [1, 1, 1, 0, 0]   (t > 2)
    nontrigger_suffix keep = [1, 1, 1, 0, 0]   (t > 2, and t = 3, 4 are not triggers)
    sequence          keep = [0, 0, 0, 0, 0]
    trigger           keep = [1, 1, 0, 1, 1]

With A = +1 nothing is vetoed. Loss per kept token (clip [0, 5]), A = −1: −min(−ρ, −clip(ρ)) = ρ
→ [1.2, 0.8, 2e-5, 0, 0] for "suffix"; A = +1, ρ = 6 → −5 (clipped), A = −1, ρ = 0.1 → 0.1 (unclipped).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_micro_batch_invariant, info_for, leaf, make_logp, make_rollout, rollout_from, train_recorded

from groupwise.losses.mu_grpo import veto_keep
from groupwise.registry import build

PROBS = [0.6, 0.4, 1e-5, 0.45, 0.5]
KEEP = {
    "suffix": [1, 1, 1, 0, 0],
    "nontrigger_suffix": [1, 1, 1, 0, 0],
    "sequence": [0, 0, 0, 0, 0],
    "trigger": [1, 1, 0, 1, 1],
}


def _spec_row(adv: float, probs=PROBS):
    logp_old = torch.full((1, 1, len(probs)), math.log(0.5))  # [1,1,T]
    ro = rollout_from(logp_old, torch.tensor([[adv]]))
    logp = leaf([[[math.log(p) for p in probs]]])  # [1,1,T]
    return ro, logp


@pytest.mark.parametrize("scope", sorted(KEEP))
def test_spec_keep_masks(scope):
    ro, logp = _spec_row(-1.0)
    ratio = torch.exp(logp - ro.logp_old)
    keep = veto_keep(ratio, torch.full_like(ratio, -1.0), ro.mask, 1e-4, scope)
    assert keep.long().flatten().tolist() == KEEP[scope]
    keep_pos = veto_keep(ratio, torch.full_like(ratio, 1.0), ro.mask, 1e-4, scope)
    assert keep_pos.all()  # positive rows are never vetoed


def test_spec_loss_and_gradient_on_the_suffix_scope():
    ro, logp = _spec_row(-1.0)
    term = build("objective", "mu_grpo")
    loss = term(ro, {"logp": logp}, info_for(5))
    torch.testing.assert_close(loss.detach().flatten(), torch.tensor([1.2, 0.8, 2e-5, 0.0, 0.0]), atol=1e-6, rtol=0)
    loss.sum().backward()
    # d(ρ)/d(logp) = ρ on kept tokens (no clip is active: 0 ≤ ρ ≤ 5), 0 on the vetoed suffix
    torch.testing.assert_close(logp.grad.flatten(), torch.tensor([1.2, 0.8, 2e-5, 0.0, 0.0]), atol=1e-6, rtol=0)
    stats = term.stats(ro, {"logp": logp})
    assert stats["mu_grpo/vetoed"].flatten().tolist() == [0, 0, 0, 1, 1]
    assert stats["mu_grpo/triggered"].flatten().tolist() == [0, 0, 1, 0, 0]


def test_relaxed_clip_by_hand():
    term = build("objective", "mu_grpo")
    # ρ = 1.5 / 0.5 = 3: inside [0, 5] (a "probability" of 1.5 is only a log-ratio here)
    ro, logp = _spec_row(1.0, [1.5])
    assert term(ro, {"logp": logp}, info_for(1)).item() == pytest.approx(-3.0, abs=1e-6)
    logp_old = torch.full((1, 1, 1), math.log(0.1))
    ro6 = rollout_from(logp_old, torch.tensor([[1.0]]))
    # ρ = 6 → 5
    assert term(ro6, {"logp": leaf([[[math.log(0.6)]]])}, info_for(1)).item() == pytest.approx(-5.0, abs=1e-6)
    ro_neg = rollout_from(logp_old, torch.tensor([[-1.0]]))
    # unclipped
    assert term(ro_neg, {"logp": leaf([[[math.log(0.01)]]])}, info_for(1)).item() == pytest.approx(0.1, abs=1e-6)


def test_masked_tokens_never_trigger_and_the_veto_follows_the_first_trigger():
    # ratio [1, 1e-6 (masked), 1, 1e-6, 1, 1e-6]: the masked collapse is ignored, the first real one is t = 3
    ratio = torch.tensor([[[1.0, 1e-6, 1.0, 1e-6, 1.0, 1e-6]]])
    mask = torch.tensor([[[True, False, True, True, True, True]]])
    adv = torch.full_like(ratio, -1.0)
    assert veto_keep(ratio, adv, mask, 1e-4, "suffix").long().flatten().tolist() == [1, 1, 1, 1, 0, 0]
    assert veto_keep(ratio, adv, mask, 1e-4, "nontrigger_suffix").long().flatten().tolist() == [1, 1, 1, 1, 0, 1]
    assert veto_keep(ratio, adv, mask, 1e-4, "trigger").long().flatten().tolist() == [1, 1, 1, 0, 1, 0]


def test_without_a_trigger_it_is_ppo_clip_with_the_same_bounds():
    ro = make_rollout()
    logp = make_logp(ro)
    out = {"logp": logp}
    mine = build("objective", "mu_grpo", eps_low=0.2, eps_high=0.28, delta=1e-30)(ro, out, info_for(6))
    ppo = build("objective", "ppo_clip", eps_low=0.2, eps_high=0.28)(ro, out, info_for(6))
    torch.testing.assert_close(mine, ppo, atol=0, rtol=0)
    # the relaxed [0, 5] too: ppo_clip accepts eps_low = 1 (no lower clip); the other clipping terms keep eps_low < 1
    relaxed = build("objective", "mu_grpo", delta=1e-30)(ro, out, info_for(6))
    torch.testing.assert_close(
        relaxed, build("objective", "ppo_clip", eps_low=1.0, eps_high=4.0)(ro, out, info_for(6)), atol=0, rtol=0
    )
    with pytest.raises(ValueError, match=r"eps_low must be in \[0, 1\)"):
        build("objective", "gspo", eps_low=1.0)


def test_micro_batch_invariant():
    ro = make_rollout(6, 4, 6, seed=5)
    logp = make_logp(ro, scale=6.0)  # large moves: some ratios collapse under delta
    for scope in ("suffix", "sequence"):
        term = build("objective", "mu_grpo", delta=0.05, scope=scope)
        assert term.stats(ro, {"logp": logp})["mu_grpo/vetoed"].sum() > 0
        for agg in ("token_mean", "seq_mean_token_mean"):
            assert_micro_batch_invariant(term, agg, ro, logp)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"eps_low": 1.5}, "eps_low"),
        ({"delta": 0.0}, "delta"),
        ({"scope": "prefix"}, "scope"),
        ({"eps_high": -1.0}, "eps_high"),
    ],
)
def test_bad_options_name_the_field(params, match):
    with pytest.raises(ValueError, match=match):
        build("objective", "mu_grpo", **params)


def test_two_stale_epochs_on_the_embedded_model(tmp_path):
    rows, _ = train_recorded(tmp_path, "mu_grpo", "train.epochs=3", "train.minibatches=2")
    for row in rows:
        assert 0.0 <= row["mu_grpo/vetoed"] <= 1.0 and math.isfinite(row["loss"])
