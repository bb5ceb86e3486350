"""Sampler/trainer mismatch correction (``weight`` ``sampler_is``) worked by hand, then parity.

``ρ = exp(logp_old − logp_sampler)`` per token or per sequence (product over the row), truncated
(TIS) or zeroed outside [lo, hi] (MIS), times the off-policy sequence mask (OPSM). Parity with TRL
1.16 (trl/trainer/grpo_trainer.py): the IS ratio of ``_generate_and_score_completions`` is
reproduced from its source (it is computed inline there), TRL's static ``get_off_policy_mask`` is
called directly, and ``_compute_loss`` is called on a stand-in ``self`` with ``use_vllm`` and the
ratio, to compare the loss and gradient of the whole objective (where the weight goes, which
normaliser it keeps). verl's ``compute_rollout_correction_weights`` and
``compute_rollout_rejection_mask`` (verl/trainer/ppo/rollout_corr_helper.py) are re-derived by hand.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers import info_for, leaf, make_rollout, objective_for, rollout_from

from groupwise.objective import token_weights
from groupwise.registry import build
from groupwise.types import Need

LN2, LN4 = math.log(2.0), math.log(4.0)
NAN = float("nan")


def _batch(gap, mask=None, adv=None, valid=None):
    """logp_old = −1; logp_sampler = logp_old − ``gap``, so the token ratio is e^gap."""
    gap = torch.as_tensor(gap, dtype=torch.float32)
    old = -torch.ones_like(gap)
    adv = torch.ones(gap.shape[:2]) if adv is None else torch.as_tensor(adv, dtype=torch.float32)
    ro = rollout_from(old, adv, mask=mask, logp_sampler=old - gap)
    if valid is not None:
        ro.group_valid = torch.as_tensor(valid, dtype=torch.bool)
    return ro


def _w(ro, **params):
    return build("weight", "sampler_is", **params)(ro, info_for(ro.shape[2]))


# ---------------------------------------------------------------------------------------------- by hand
def test_defaults_and_needs():
    w = build("weight", "sampler_is")
    assert (w.mode, w.hi, w.lo, w.off_policy_threshold, w.scope) == ("sequence_mask", 3.0, None, None, "loss")
    assert w.needs == (Need("logp"),)


def test_token_modes_by_hand():
    # token ratios e^gap = [2, 4, 0.5, NaN → 1 (TRL: no correction where the engine gave none)]
    ro = _batch([[[LN2, LN4, -LN2, NAN]]])
    torch.testing.assert_close(_w(ro, mode="token_truncate"), torch.tensor([[[2.0, 3.0, 0.5, 1.0]]]))  # min(ρ, 3)
    torch.testing.assert_close(_w(ro, mode="token_mask"), torch.tensor([[[2.0, 0.0, 0.5, 1.0]]]))  # 4 > 3 → 0
    # 0.5 < 0.6 → 0
    torch.testing.assert_close(_w(ro, mode="token_mask", lo=0.6), torch.tensor([[[2.0, 0.0, 0.0, 1.0]]]))
    torch.testing.assert_close(_w(ro, mode="token_truncate", lo=0.6, hi=None), torch.tensor([[[2.0, 4.0, 0.6, 1.0]]]))
    torch.testing.assert_close(_w(ro, mode="none"), torch.ones(1, 1, 4))


def test_sequence_modes_by_hand_ignore_padding():
    # row 0: gaps [ln2, ln2] → ρ = 2·2 = 4; row 1: [ln2, −ln4, garbage on a masked token] → 2·¼ = 0.5
    ro = _batch([[[LN2, LN2, 0.0], [LN2, -LN4, 30.0]]], mask=torch.tensor([[[1, 1, 0], [1, 1, 0]]]))
    # sequence_mask (hi 3): row 0's 4 > 3 → every token 0; row 1 keeps 0.5; masked positions 0
    torch.testing.assert_close(_w(ro), torch.tensor([[[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]]]))
    torch.testing.assert_close(_w(ro, mode="sequence_truncate"), torch.tensor([[[3.0, 3.0, 0.0], [0.5, 0.5, 0.0]]]))
    # invalid row: 0 everywhere, whatever its log-probs
    ro.group_valid = torch.tensor([[True, False]])
    assert _w(ro, mode="sequence_truncate")[0, 1].abs().sum() == 0


def test_off_policy_sequence_mask_by_hand():
    # mean_t(logp_sampler − logp_old) = −gap: rows [0.6, 0.2, 0.9, 0.9]; adv [−1, −1, +1, 0]; δ = 0.5
    # row 0: adv < 0 and 0.6 > 0.5 → dropped; row 1: 0.2 ≤ 0.5 → kept; rows 2, 3: adv ≥ 0 → kept
    gap = -torch.tensor([0.6, 0.2, 0.9, 0.9]).view(1, 4, 1).expand(1, 4, 2)
    ro = _batch(gap, adv=[[-1.0, -1.0, 1.0, 0.0]])
    w = build("weight", "sampler_is", mode="none", off_policy_threshold=0.5)
    torch.testing.assert_close(w(ro, info_for(2)), torch.tensor([[[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]]))
    assert w.step_stats()["sampler_is/opsm_frac"] == pytest.approx(2 / 8)  # 2 of the 8 loss tokens dropped
    # combined with the ratio: token_truncate ρ = e^−0.2 = 0.818731 on row 1, and row 0 still dropped
    both = _w(ro, mode="token_truncate", off_policy_threshold=0.5)
    assert both[0, 0].abs().sum() == 0 and both[0, 1].tolist() == pytest.approx([math.exp(-0.2)] * 2, rel=1e-6)
    # token advantages: the rule is applied per token (TRL broadcasts (B,T) advantages the same way)
    ro.advantages = torch.tensor([[[-1.0, 1.0], [-1.0, -1.0], [1.0, 1.0], [1.0, 1.0]]])
    assert w(ro, info_for(2))[0, 0].tolist() == [0.0, 1.0]
    ro.advantages = None
    with pytest.raises(ValueError, match="advantages"):
        w(ro, info_for(2))


def test_step_stats_by_hand():
    # token_truncate, hi 3 on ratios [2, 4, 0.5] (+ one masked garbage token):
    # applied [2, 3, 0.5] → mean 5.5/3 = 1.833333, min 0.5, max 3; raw max 4; outside [0, 3]: 1 of 3
    # |logp_old − logp_sampler| = [ln2, ln4, ln2] → mean 4·ln2/3 = 0.924196, max ln4 = 1.386294
    ro = _batch([[[LN2, LN4, -LN2, 50.0]]], mask=torch.tensor([[[1, 1, 1, 0]]]))
    w = build("weight", "sampler_is", mode="token_truncate")
    w(ro, info_for(4))
    s = w.step_stats()
    assert s["sampler_is/mean"] == pytest.approx(5.5 / 3, rel=1e-6)
    assert (s["sampler_is/min"], s["sampler_is/max"], s["sampler_is/raw_max"]) == pytest.approx(
        (0.5, 3.0, 4.0), rel=1e-6
    )
    assert s["sampler_is/capped_frac"] == pytest.approx(1 / 3)
    assert s["sampler_is/logp_diff_mean"] == pytest.approx(4 * LN2 / 3, rel=1e-6)
    assert s["sampler_is/logp_diff_max"] == pytest.approx(LN4, rel=1e-6)
    assert s["sampler_is/opsm_frac"] == 0.0 and s["sampler_is/no_sampler_logp"] == 0.0
    # sequence modes count rows: ρ_seq = 2·4·0.5 = 4 > 3 → masked; 1 row, capped fraction 1, mean 0
    w = build("weight", "sampler_is")
    w(ro, info_for(4))
    assert (w.step_stats()["sampler_is/capped_frac"], w.step_stats()["sampler_is/mean"]) == (1.0, 0.0)


def test_edge_cases_and_errors():
    # a huge log-ratio is clamped to ±20 (verl's SAFETY_BOUND): finite even without a cap
    big = _batch([[[1000.0, -1000.0]]])
    torch.testing.assert_close(_w(big, mode="token_truncate", hi=None), torch.tensor([[[math.exp(20), math.exp(-20)]]]))
    # no sampler log-probs (an engine that reports none): ρ = 1, flagged in the statistics
    ro = _batch([[[LN4, LN4]]])
    ro.logp_sampler = None
    w = build("weight", "sampler_is", mode="token_mask")
    assert w(ro, info_for(2)).tolist() == [[[1.0, 1.0]]] and w.step_stats()["sampler_is/no_sampler_logp"] == 1.0
    ro.logp_old = None
    with pytest.raises(ValueError, match="logp_old"):
        w(ro, info_for(2))
    for bad in ({"mode": "row_mask"}, {"scope": "all"}, {"hi": 0.0}, {"lo": -1.0}, {"lo": 4.0, "hi": 3.0}):
        with pytest.raises(ValueError, match="sampler_is"):
            build("weight", "sampler_is", **bad)


@pytest.mark.parametrize("scope,den", [("loss", 2), ("token", 1)])
def test_scope_decides_the_normaliser(scope, den):
    # one row, 2 tokens, A = 1, logp = −1: reinforce values 1 per token; token_mask weights [2, 0]
    # token_mean: scope "loss" (TRL): (2·1 + 0)/2 tokens = 1; scope "token" (verl rollout_rs): 2/1 = 2
    # kl term (unweighted; logp_ref = logp_old − 0.5·[1, 1] → k3 at d = −0.5 = 0.106531 per token):
    # "loss": both tokens count → 0.04·(2·0.106531)/2; "token": the masked token leaves KL too → 0.04·0.106531/1
    ro = _batch([[[LN2, LN4]]])
    ro.logp_ref = ro.logp_old - 0.5
    w = build("weight", "sampler_is", mode="token_mask", scope=scope)
    ro.weight, counted = token_weights([w], ro, info_for(2))
    ro.set_extra("counted", counted, "token")
    logp = leaf([[[-1.0, -1.0]]])
    obj = objective_for([build("objective", "reinforce"), build("objective", "kl")], "token_mean")
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(2)), info_for(2))
    k3 = math.exp(-0.5) + 0.5 - 1
    kl_part = 0.04 * (2 * k3 / 2 if scope == "loss" else k3)
    assert loss.item() == pytest.approx(2.0 / den + kl_part, rel=1e-6)
    loss.backward()
    # d/dlogp: reinforce −A·w/den; kl 0.04·(1 − e^d)/den' on the tokens it covers
    kl_grad = 0.04 * (1 - math.exp(-0.5))
    expect = [-2.0 / den + kl_grad / den, kl_grad / 2 if scope == "loss" else 0.0]
    assert logp.grad.flatten().tolist() == pytest.approx(expect, rel=1e-6)


# ---------------------------------------------------------------------------------------------- TRL parity
def _trl_is_ratio(old, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16 ``_generate_and_score_completions`` IS block, from its source, on [N,T] tensors."""
    diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    logps_diff = diff.sum(dim=-1, keepdim=True) if mode in ("sequence_mask", "sequence_truncate") else diff
    ratio = torch.exp(logps_diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def _mismatched(seed=61, B=3, G=4, T=6):
    ro = make_rollout(B, G, T, seed=seed, awkward=False)
    g = torch.Generator().manual_seed(seed + 1)
    ro.logp_sampler = ro.logp_old - 0.6 * torch.randn(B, G, T, generator=g)
    ro.logp_sampler[0, 1, 0] = NAN  # a token the engine could not score
    return ro


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("lo,hi", [(None, 3.0), (0.5, 1.5)])
def test_trl_parity_is_ratio(mode, lo, hi):
    ro = _mismatched()
    B, G, T = ro.shape
    N, m = B * G, ro.mask.reshape(B * G, T)
    trl = _trl_is_ratio(ro.logp_old.reshape(N, T), ro.logp_sampler.reshape(N, T), m.float(), mode, lo, hi).expand(N, T)
    ours = _w(ro, mode=mode, lo=lo, hi=hi).reshape(N, T)
    diff = (ours[m] - trl[m]).abs().max().item()
    print(
        f"TRL parity sampler_is {mode} lo={lo} hi={hi}: max |Δ| "
        f"{diff:.2e} (range {trl[m].min():.3g}..{trl[m].max():.3g})"
    )
    assert diff < 1e-6 and (ours[~m] == 0).all()
    assert (trl[m] != 1).float().mean() > 0.5  # the ratios are really away from 1
    if mode.endswith("mask"):
        assert (trl[m] == 0).any()


def _trl_loss(ro, logp, loss_type, beta, is_ratio, opsm=None):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` with vLLM IS correction on, via a stand-in ``self``."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    B, G, T = ro.shape
    N = B * G
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp.reshape(N, T), torch.zeros(N, T), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=opsm,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.2,
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction="sum": t, gather=lambda t: t),
    )
    m = ro.mask.reshape(N, T)
    inputs = dict(
        prompt_ids=torch.zeros(N, 1, dtype=torch.long),
        prompt_mask=torch.ones(N, 1, dtype=torch.long),
        completion_ids=torch.zeros(N, T, dtype=torch.long),
        completion_mask=m.long(),
        advantages=ro.advantages.reshape(N),
        old_per_token_logps=ro.logp_old.reshape(N, T),
        ref_per_token_logps=ro.logp_ref.reshape(N, T),
        sampling_per_token_logps=ro.logp_sampler.reshape(N, T),
        importance_sampling_ratio=is_ratio,
        num_items_in_batch=m.sum().float(),
    )
    return GRPOTrainer._compute_loss(fake, None, inputs)


@pytest.mark.parametrize("loss_type,agg", [("grpo", "seq_mean_token_mean"), ("bnpo", "token_mean")])
@pytest.mark.parametrize(
    "mode,opsm", [("token_mask", None), ("sequence_mask", None), ("token_truncate", None), ("token_mask", 0.05)]
)
def test_trl_parity_loss_with_sampler_is(loss_type, agg, mode, opsm):
    # TRL: per_token_loss = ppo_clip · off_policy_mask · is_ratio + beta·k3, aggregated by loss_type with
    # completion_mask (masked tokens keep their place in the normaliser) = our scope "loss".
    # On-policy in θ (logp = logp_old, TRL's first pass, where its OPSM uses π_old too).
    pytest.importorskip("trl")
    ro = _mismatched(seed=71)
    B, G, T = ro.shape
    N, m = B * G, ro.mask.reshape(B * G, T)
    logp = ro.logp_old.detach().clone().requires_grad_(True)
    lo, hi = 0.8, 1.25
    is_ratio = _trl_is_ratio(ro.logp_old.reshape(N, T), ro.logp_sampler.reshape(N, T), m.float(), mode, lo, hi)
    trl_loss = _trl_loss(ro, logp, loss_type, 0.04, is_ratio, opsm)
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    w = build("weight", "sampler_is", mode=mode, lo=lo, hi=hi, off_policy_threshold=opsm)
    ro.weight, counted = token_weights([w], ro, info_for(T))
    ro.set_extra("counted", counted, "token")
    obj = objective_for([build("objective", "ppo_clip"), build("objective", "kl")], agg)
    x = logp.detach().clone().requires_grad_(True)
    loss = obj.loss(ro, {"logp": x}, obj.normalizers(ro, info_for(T)), info_for(T))
    (grad,) = torch.autograd.grad(loss, x)
    d_loss, d_grad = abs(loss.item() - trl_loss.item()), (grad - trl_grad).abs().max().item()
    print(f"TRL parity loss {loss_type} sampler_is={mode} opsm={opsm}: max |Δ| loss {d_loss:.2e}, grad {d_grad:.2e}")
    assert d_loss < 1e-6 and d_grad < 1e-7
    assert counted[ro.mask].all()  # every token still counted (scope "loss"), zero weight or not
    if mode.endswith("mask"):
        assert ((ro.weight == 0) & ro.mask).any()
    if opsm is not None:
        assert w.step_stats()["sampler_is/opsm_frac"] > 0


def test_trl_parity_off_policy_mask():
    # TRL's static GRPOTrainer.get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps,
    # mask, threshold) → (B,1) keep; per_token_logps = π_old (first pass). Ours: mode "none" + OPSM.
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    ro = _mismatched(seed=81, B=4, G=6, T=7)
    B, G, T = ro.shape
    N, m = B * G, ro.mask.reshape(B * G, T)
    for delta in (0.0, 0.05, 0.2):
        keep = GRPOTrainer.get_off_policy_mask(
            ro.advantages.reshape(N, 1), ro.logp_old.reshape(N, T), ro.logp_sampler.reshape(N, T), m.float(), delta
        )  # [N,1]
        ours = _w(ro, mode="none", off_policy_threshold=delta).reshape(N, T)
        diff = (ours[m] - keep.expand(N, T)[m]).abs().max().item()
        print(f"TRL parity off_policy_mask δ={delta}: max |Δ| {diff:.2e}, dropped rows {int((keep == 0).sum())}/{N}")
        assert diff == 0.0 and 0 < int((keep == 0).sum()) < N


# ---------------------------------------------------------------------------------------------- verl parity
def test_verl_parity_rollout_correction():
    # verl compute_rollout_correction_weights(log_ratio = old − rollout, mask, rollout_is, threshold = 2):
    #   "token":    exp(clamp(log_ratio, ±20))·mask, clamp(max=2)
    #   "sequence": exp(clamp(Σ_t log_ratio·mask, ±20)) broadcast, ·mask, clamp(max=2)
    # row 0 gaps [ln2, ln4] → token [2, 2 (4 capped)]; sequence e^{ln 8} = 8 → 2 on both tokens
    # row 1 gaps [−ln2, ln2·0.5] → token [0.5, √2 = 1.414214]; sequence 2^{−0.5} = 0.707107
    ro = _batch([[[LN2, LN4], [-LN2, 0.5 * LN2]]])
    torch.testing.assert_close(_w(ro, mode="token_truncate", hi=2.0), torch.tensor([[[2.0, 2.0], [0.5, math.sqrt(2)]]]))
    torch.testing.assert_close(
        _w(ro, mode="sequence_truncate", hi=2.0), torch.tensor([[[2.0, 2.0], [2**-0.5, 2**-0.5]]])
    )
    # verl compute_rollout_rejection_mask("token_k1", threshold 2 → lower 0.5): k1 = −log_ratio; keep
    # log 0.5 ≤ k1 ≤ log 2, i.e. 0.5 ≤ ρ ≤ 2 → row 0 [keep (ρ 2), reject (ρ 4)], row 1 [keep, keep];
    # it edits response_mask (scope "token"): the rejected token leaves the loss and every normaliser.
    w = build("weight", "sampler_is", mode="token_mask", lo=0.5, hi=2.0, scope="token")
    weight, counted = token_weights([w], ro, info_for(2))
    assert counted.tolist() == [[[True, False], [True, True]]]
    # "seq_sum_k1" with threshold 2: Σ_t k1 = −log ρ_seq ∈ [log 0.5, log 2] → row 0 (ρ 8) rejected, row 1 kept
    w_seq = build("weight", "sampler_is", mode="sequence_mask", lo=0.5, hi=2.0, scope="token")
    assert token_weights([w_seq], ro, info_for(2))[1].tolist() == [[[False, False], [True, True]]]
    print("verl parity rollout correction: hand-derived weights and masks equal (max |Δ| 0)")


def test_garbage_on_padding_never_reaches_the_weights():
    # make_rollout: ragged groups, an invalid row, a fully masked row, ±30 garbage in logp_old padding;
    # logp_sampler = 1e4 on padding. Inside: gap 0.1 per token → token ρ = e^0.1, sequence ρ = e^{0.1·len}
    ro = make_rollout(3, 4, 5, seed=5)
    ro.logp_sampler = torch.where(ro.mask, ro.logp_old - 0.1, torch.full_like(ro.logp_old, 1e4))
    lengths = ro.row_mask.sum(-1, keepdim=True).float()  # [B,G,1] loss tokens per row (≤ 5: e^0.5 < 3)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        w = _w(ro, mode=mode)
        assert torch.isfinite(w).all() and (w[~ro.row_mask] == 0).all() and not w.requires_grad
        expect = torch.exp(0.1 * (torch.ones_like(lengths) if mode.startswith("token") else lengths)).expand(w.shape)
        torch.testing.assert_close(w[ro.row_mask], expect[ro.row_mask])
