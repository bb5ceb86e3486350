"""KL forms worked by hand: the abs / low_var_kl / straight-through "+" estimators, the
importance-weighted (bias-corrected) KL term of TRL 1.16, the adaptive KL controller, and the
``seq_mean_token_sum`` aggregation; then parity with the references.

Parity: TRL 1.16's own ``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py) is called on a
stand-in ``self`` (beta ≠ 0, ``use_bias_correction_kl`` on and off). verl is not installed: its
``kl_penalty`` / ``kl_penalty_forward`` and ``agg_loss`` (verl/trainer/ppo/core_algos.py),
``AdaptiveKLController`` and ``apply_kl_penalty`` (verl/trainer/ppo/ray_trainer.py) are re-derived by
hand with the expected values in comments. TRL ≤ 0.11's ``AdaptiveKLController`` (trl/trainer/utils.py,
updated with ``objective/kl`` = mean over rows of Σ_t (logp − logp_ref)) is re-derived likewise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers import info_for, leaf, make_logp, make_rollout, objective_for, rollout_from

from groupwise import schedules
from groupwise.errors import ConfigError
from groupwise.registry import build

E05, EM05, E02, EM01 = (
    math.exp(0.5),
    math.exp(-0.5),
    math.exp(0.2),
    math.exp(-0.1),
)  # 1.648721 0.606531 1.221403 0.904837
K3_M05 = EM05 + 0.5 - 1.0  # k3 at d = −0.5: 0.106531
K3_P05 = E05 - 0.5 - 1.0  # k3 at d = +0.5: 0.148721


def _value_grad(name, logp, ref):
    x = leaf(logp)
    kl = build("kl", name)(x, torch.as_tensor(ref, dtype=torch.float32))
    kl.sum().backward()
    return kl.detach(), x.grad


# ---------------------------------------------------------------------------------------------- estimators
@pytest.mark.parametrize(
    "name,value,grad",
    [
        # logp = −1, logp_ref = −1.5: logp − logp_ref = 0.5, d = logp_ref − logp = −0.5
        ("abs", 0.5, 1.0),  # |0.5| = 0.5; d/dlogp = sign(0.5) = 1
        ("low_var_kl", K3_M05, 1.0 - EM05),  # inside the clamps: k3 = 0.106531, grad 1 − e^−0.5 = 0.393469
        ("k1+", 0.5, 0.5),  # k1's value 0.5; k2's gradient logp − logp_ref = 0.5 (k1's own: 1)
        ("k3+", K3_M05, 0.5),  # k3's value 0.106531; k2's gradient 0.5 (k3's own: 0.393469)
        ("abs+", 0.5, 0.5),  # |0.5|; k2's gradient 0.5
        ("low_var_kl+", K3_M05, 0.5),
    ],
)
def test_estimators_by_hand(name, value, grad):
    kl, g = _value_grad(name, [-1.0], [-1.5])
    assert kl.item() == pytest.approx(value, rel=1e-6) and g.item() == pytest.approx(grad, rel=1e-6)


def test_estimators_negative_log_ratio():
    # logp = −1.5, logp_ref = −1: logp − logp_ref = −0.5 → abs 0.5 with gradient −1; k1+ value −0.5,
    # gradient (k2's) −0.5; k3+ value k3(d = +0.5) = 0.148721, gradient −0.5
    assert _value_grad("abs", [-1.5], [-1.0]) == (
        pytest.approx(torch.tensor([0.5])),
        pytest.approx(torch.tensor([-1.0])),
    )
    kl, g = _value_grad("k1+", [-1.5], [-1.0])
    assert kl.item() == pytest.approx(-0.5) and g.item() == pytest.approx(-0.5)
    kl, g = _value_grad("k3+", [-1.5], [-1.0])
    assert kl.item() == pytest.approx(K3_P05, rel=1e-6) and g.item() == pytest.approx(-0.5)


def test_low_var_kl_clamps_like_verl():
    # verl kl_penalty_forward("low_var_kl"): d = clamp(ref − logp, −20, 20), k = clamp(e^d − d − 1, −10, 10)
    # d = 2:   e^2 − 3 = 4.389056 (inside: equals k3, gradient 1 − e^2 = −6.389056)
    # d = 3:   e^3 − 4 = 16.085537 → 10, gradient 0        d = 25: d → 20, e^20 − 21 → 10, gradient 0
    # d = −12: e^−12 + 11 = 11.000006 → 10, gradient 0     d = −10: e^−10 + 9 = 9.0000454 (inside)
    logp = [0.0, 0.0, 0.0, 0.0, 0.0]
    ref = [2.0, 3.0, 25.0, -12.0, -10.0]
    kl, g = _value_grad("low_var_kl", logp, ref)
    torch.testing.assert_close(kl, torch.tensor([math.exp(2) - 3, 10.0, 10.0, 10.0, math.exp(-10) + 9]))
    torch.testing.assert_close(g, torch.tensor([1 - math.exp(2), 0.0, 0.0, 0.0, 1 - math.exp(-10)]))
    k3, _ = _value_grad("k3", logp, ref)
    assert k3[1].item() == pytest.approx(math.exp(3) - 4) and k3[2].item() > 1e8  # plain k3 is not clamped
    # the + form keeps the clamped value but takes k2's gradient logp − ref = −d everywhere
    kl_p, g_p = _value_grad("low_var_kl+", logp, ref)
    torch.testing.assert_close(kl_p, kl)
    torch.testing.assert_close(g_p, -torch.tensor(ref))


def test_verl_parity_straight_through():
    # verl kl_penalty (core_algos.py) for NAME+: backward = ½(logp − ref)²;
    # return backward − backward.detach() + kl_penalty_forward(NAME).detach()
    # → value of NAME, gradient (logp − ref). Re-derived on random tensors per base estimator.
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 3, 7, generator=g) * 3
    ref = logp + 0.8 * torch.randn(4, 3, 7, generator=g)
    forward = {  # verl kl_penalty_forward, written from its source
        "k1": logp - ref,
        "abs": (logp - ref).abs(),
        "k3": torch.exp(ref - logp) - (ref - logp) - 1,
        "low_var_kl": (torch.exp((ref - logp).clamp(-20, 20)) - (ref - logp).clamp(-20, 20) - 1).clamp(-10, 10),
    }
    worst = 0.0
    for base, value in forward.items():
        kl, grad = _value_grad(base + "+", logp, ref)
        d_val, d_grad = (kl - value).abs().max().item(), (grad - (logp - ref)).abs().max().item()
        worst = max(worst, d_val, d_grad)
        assert d_val < 1e-6 and d_grad < 1e-6, base
        base_kl, base_grad = _value_grad(base, logp, ref)
        assert (base_grad - grad).abs().max() > 0.1  # the + form really changes the gradient
    print(f"verl parity kl '+' forms: max |Δ| value/grad {worst:.2e}")


def test_plus_forms_zero_at_equal_and_finite_on_padding():
    # the kl term neutralises padding: garbage (±1e4) there gives exactly 0 value and gradient
    for name in ("abs", "abs+", "k1+", "k3+", "low_var_kl", "low_var_kl+"):
        term = build("objective", "kl", estimator=name)
        mb = rollout_from(
            torch.zeros(1, 1, 3), None, mask=torch.tensor([[[1, 1, 0]]]), logp_ref=torch.tensor([[[-1.5, -1.0, 1e4]]])
        )
        logp = leaf([[[-1.0, -1.0, -1e4]]])
        values = term(mb, {"logp": logp}, info_for(3))
        values.sum().backward()
        assert values[0, 0, 1].item() == 0.0 and values[0, 0, 2].item() == 0.0, name  # equal → 0; masked → 0
        assert logp.grad[0, 0, 2].item() == 0.0 and torch.isfinite(logp.grad).all(), name


# --------------------------------------------------------------------------------------------- KL term, bias correction
def _two_tokens():
    # logp = [−1, −1], logp_old = [−1.2, −0.9] → ratio [e^0.2, e^−0.1] = [1.221403, 0.904837]
    # logp_ref = [−1.5, −0.5] → d = [−0.5, +0.5], k3 = [0.106531, 0.148721]
    mb = rollout_from(
        torch.tensor([[[-1.2, -0.9, 5.0]]]),
        None,
        mask=torch.tensor([[[1, 1, 0]]]),
        logp_ref=torch.tensor([[[-1.5, -0.5, 9.0]]]),
    )
    return mb, leaf([[[-1.0, -1.0, 3.0]]])


def test_kl_term_defaults_unchanged():
    term = build("objective", "kl")
    assert (term.coef, term.estimator, term.bias_correction, term.is_level) == (0.04, "k3", False, "token")
    mb, logp = _two_tokens()
    torch.testing.assert_close(term(mb, {"logp": logp}, info_for(3)), torch.tensor([[[K3_M05, K3_P05, 0.0]]]))


def test_kl_bias_correction_token_by_hand():
    mb, logp = _two_tokens()
    term = build("objective", "kl", bias_correction=True)
    values = term(mb, {"logp": logp}, info_for(3))
    # ratio · k3 = [1.221403·0.106531, 0.904837·0.148721] = [0.130118, 0.134568]; masked token 0
    torch.testing.assert_close(values, torch.tensor([[[E02 * K3_M05, EM01 * K3_P05, 0.0]]]))
    values.sum().backward()
    # ∂(r·k3)/∂logp = r·k3 + r·(1 − e^d) = r·(logp − logp_ref): [1.221403·0.5, 0.904837·(−0.5)]
    torch.testing.assert_close(logp.grad, torch.tensor([[[E02 * 0.5, -EM01 * 0.5, 0.0]]]))
    assert term.stats(mb, {"logp": logp})["kl"][0, 0, :2].tolist() == pytest.approx(
        [E02 * K3_M05, EM01 * K3_P05], rel=1e-6
    )


def test_kl_bias_correction_sequence_by_hand():
    mb, logp = _two_tokens()
    term = build("objective", "kl", bias_correction=True, is_level="sequence")
    values = term(mb, {"logp": logp}, info_for(3))
    r = math.exp((0.2 - 0.1) / 2)  # exp(mean log-ratio over the 2 loss tokens) = e^0.05 = 1.051271
    torch.testing.assert_close(values, torch.tensor([[[r * K3_M05, r * K3_P05, 0.0]]]))
    values.sum().backward()
    # ∂/∂logp_t Σ_s r·k3_s = r·(½ Σ_s k3_s) + r·(1 − e^{d_t});  ½ Σ k3 = 0.127626
    # token 0: r·(0.127626 + 0.393469) = 0.547813; token 1: r·(0.127626 − 0.648721) = −0.547813
    half = (K3_M05 + K3_P05) / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[[r * (half + 1 - EM05), r * (half + 1 - E05), 0.0]]]))


def test_kl_bias_correction_on_policy_gradient_is_k2():
    # on-policy (logp_old = logp): value = k3 (ratio 1), gradient = (logp − ref)·∇logp = ∇k2 = ∇k3+
    ro = make_rollout(2, 3, 5, seed=3)
    logp = make_logp(ro, seed=4)
    ro.logp_old = torch.where(ro.mask, logp.detach(), ro.logp_old)
    grads = {}
    for name, params in {"bc": {"bias_correction": True}, "k3+": {"estimator": "k3+"}, "k3": {}}.items():
        x = logp.detach().clone().requires_grad_(True)
        obj = objective_for([build("objective", "kl", **params)], "token_mean")
        loss = obj.loss(ro, {"logp": x}, obj.normalizers(ro, info_for(5)), info_for(5))
        (grads[name],) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(grads["bc"], grads["k3+"], atol=1e-8, rtol=1e-6)
    assert (grads["bc"] - grads["k3"]).abs().max() > 1e-4  # plain k3's gradient differs


def test_kl_term_rejects_bad_options():
    with pytest.raises(ValueError, match="is_level"):
        build("objective", "kl", is_level="row")
    with pytest.raises(ConfigError):
        build("objective", "kl", estimator="k2+")  # verl has no distinct k2+ (k2 is its own gradient)
    mb, logp = _two_tokens()
    mb.logp_old = None
    with pytest.raises(ValueError, match="logp_old"):
        build("objective", "kl", bias_correction=True)(mb, {"logp": logp}, info_for(3))


def _trl_compute_loss(loss_type, logp, logp_old, logp_ref, adv, mask, beta, bias_correction, level="token"):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` on [N,T] tensors via a stand-in ``self``; (loss, metrics)."""
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    metrics = defaultdict(lambda: defaultdict(list))
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.2,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=bias_correction, steps_per_generation=1),
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=metrics,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction="sum": t, gather=lambda t: t),
    )
    N, T = logp.shape
    inputs = dict(
        prompt_ids=torch.zeros(N, 1, dtype=torch.long),
        prompt_mask=torch.ones(N, 1, dtype=torch.long),
        completion_ids=torch.zeros(N, T, dtype=torch.long),
        completion_mask=mask.long(),
        advantages=adv,
        old_per_token_logps=logp_old,
        ref_per_token_logps=logp_ref,
        num_items_in_batch=mask.sum().float(),
    )
    return GRPOTrainer._compute_loss(fake, None, inputs), metrics["train"]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize(
    "loss_type,agg,level",
    [
        ("grpo", "seq_mean_token_mean", "token"),
        ("bnpo", "token_mean", "token"),
        ("grpo", "seq_mean_token_mean", "sequence"),
    ],
)
def test_trl_parity_kl_term(loss_type, agg, level, bias_correction):
    # TRL: per_token_loss = ppo_clip + beta·k3·(coef_1 if use_bias_correction_kl), aggregated by loss_type;
    # ours: ppo_clip (token level; gspo for TRL's sequence level) + kl(coef=beta, bias_correction, is_level).
    B, G, T, beta = 3, 4, 6, 0.04
    ro = make_rollout(B, G, T, seed=21, awkward=False)  # every row valid with ≥ 1 token (TRL counts all rows)
    logp = make_logp(ro, seed=22, scale=0.25)
    N, m = B * G, ro.mask.reshape(B * G, T)
    trl_loss, trl_metrics = _trl_compute_loss(
        loss_type,
        logp.reshape(N, T),
        ro.logp_old.reshape(N, T),
        ro.logp_ref.reshape(N, T),
        ro.advantages.reshape(N),
        m,
        beta,
        bias_correction,
        level,
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    pg = build("objective", "ppo_clip") if level == "token" else build("objective", "gspo", eps_low=0.2, eps_high=0.2)
    kl = build("objective", "kl", coef=beta, bias_correction=bias_correction, is_level=level)
    obj = objective_for([pg, kl], agg)
    x = logp.detach().clone().requires_grad_(True)
    loss = obj.loss(ro, {"logp": x}, obj.normalizers(ro, info_for(T)), info_for(T))
    (grad,) = torch.autograd.grad(loss, x)
    d_loss, d_grad = (loss - trl_loss).abs().item(), (grad - trl_grad).abs().max().item()
    d_kl = abs(obj.pop_stats()["kl"] - trl_metrics["kl"][-1])
    print(
        f"TRL parity kl {loss_type}/{level} bias_correction={bias_correction}: "
        f"max |Δ| loss {d_loss:.2e}, grad {d_grad:.2e}, kl stat {d_kl:.2e}"
    )
    assert d_loss < 1e-6 and d_grad < 1e-7 and d_kl < 1e-6
    # guard: the KL part matters, and the correction changes it (off-policy ratio ≠ 1)
    _, trl_other = _trl_compute_loss(
        loss_type,
        logp.reshape(N, T).detach(),
        ro.logp_old.reshape(N, T),
        ro.logp_ref.reshape(N, T),
        ro.advantages.reshape(N),
        m,
        beta,
        not bias_correction,
        level,
    )
    assert abs(trl_other["kl"][-1] - trl_metrics["kl"][-1]) > 1e-4


# ---------------------------------------------------------------------------------------------- adaptive KL controller
def _kl_batch(diffs, mask=None, valid=None):
    """logp_old − logp_ref = ``diffs`` per token ([B,G,T]); logp_ref = −1."""
    diffs = torch.as_tensor(diffs, dtype=torch.float32)
    ref = -torch.ones_like(diffs)
    ro = rollout_from(ref + diffs, None, mask=mask, logp_ref=ref)
    if valid is not None:
        ro.group_valid = torch.as_tensor(valid, dtype=torch.bool)
    return ro


def test_adaptive_kl_by_hand_sequence_level():
    ctl = build("schedule", "adaptive_kl", horizon=10.0)
    assert (ctl.init, ctl.target, ctl.clip, ctl.estimator, ctl.level) == (
        0.2,
        6.0,
        0.2,
        "k1",
        "sequence",
    ) and ctl.start() == 0.2
    # 2 rows, k1 per token = logp_old − logp_ref: row sums 8 and 10 → KL = 9
    # e = clip(9/6 − 1 = 0.5, ±0.2) = 0.2; value = 0.2·(1 + 0.2·2/10) = 0.208
    ro = _kl_batch([[[4.0, 4.0], [5.0, 5.0]]])
    assert ctl(info_for(2), ro) == pytest.approx(0.208) and ctl.last_kl == pytest.approx(9.0)
    # KL = (2.7+2.7 + 2.7+2.7)/2 = 5.4 → e = 0.9 − 1 = −0.1 → 0.208·(1 − 0.1·2/10) = 0.208·0.98 = 0.20384
    assert ctl(info_for(2), _kl_batch([[[2.7, 2.7], [2.7, 2.7]]])) == pytest.approx(0.20384)
    assert ctl.start() == pytest.approx(0.20384)  # the value a resumed component is rebuilt with


def test_adaptive_kl_token_mean_level_masks_and_invalid_rows():
    ctl = build("schedule", "adaptive_kl", init=1.0, target=0.1, horizon=100.0, level="token_mean")
    # row 0: tokens [0.3, 0.1 (masked: garbage 9)] → mean 0.3; row 1: [0.1, 0.1] → 0.1; row 2 invalid (garbage)
    # KL = (0.3 + 0.1)/2 = 0.2 → e = clip(0.2/0.1 − 1 = 1, ±0.2) = 0.2; n = 2 valid rows
    # value = 1·(1 + 0.2·2/100) = 1.004
    ro = _kl_batch(
        [[[0.3, 9.0], [0.1, 0.1], [50.0, 50.0]]], mask=torch.tensor([[[1, 0], [1, 1], [1, 1]]]), valid=[[1, 1, 0]]
    )
    assert ctl(info_for(2), ro) == pytest.approx(1.004) and ctl.last_kl == pytest.approx(0.2)
    # n_steps overrides the row count: 1.004·(1 + 0.2·50/100) = 1.004·1.1 = 1.1044
    fixed = build("schedule", "adaptive_kl", init=1.004, target=0.1, horizon=100.0, level="token_mean", n_steps=50)
    assert fixed(info_for(2), ro) == pytest.approx(1.1044)


def test_adaptive_kl_edge_cases():
    ctl = build("schedule", "adaptive_kl")
    empty = _kl_batch([[[1.0]]], valid=[[0]])
    assert ctl(info_for(1), empty) == 0.2 and ctl.last_kl is None  # no valid row: unchanged
    # a valid row without tokens counts with KL 0: rows [Σ=12, 0] → KL 6 = target → e = 0 → unchanged
    ro = _kl_batch([[[6.0, 6.0], [7.0, 7.0]]], mask=torch.tensor([[[1, 1], [0, 0]]]))
    assert ctl(info_for(2), ro) == pytest.approx(0.2) and ctl.last_kl == pytest.approx(6.0)
    ro.logp_ref = None
    with pytest.raises(ValueError, match="Need\\('logp', model='ref'\\)"):
        ctl(info_for(2), ro)
    for bad in ({"target": 0.0}, {"horizon": -1.0}, {"level": "row"}, {"init": -0.1}):
        with pytest.raises(ValueError):
            build("schedule", "adaptive_kl", **bad)


def test_adaptive_kl_state_resumes_exactly():
    batches = [_kl_batch(torch.full((1, 3, 2), v)) for v in (5.0, 1.0, 3.5, 2.9)]
    whole = build("schedule", "adaptive_kl", horizon=30.0)
    values = [whole(info_for(2, s), b) for s, b in enumerate(batches)]
    first = build("schedule", "adaptive_kl", horizon=30.0)
    first(info_for(2, 0), batches[0]), first(info_for(2, 1), batches[1])
    resumed = build("schedule", "adaptive_kl", horizon=30.0)
    resumed.load_state_dict(first.state_dict())
    assert resumed.start() == values[1]
    assert [resumed(info_for(2, s), b) for s, b in enumerate(batches[2:], 2)] == values[2:]
    assert len(set(values)) == 4  # it moved every step


def test_verl_and_trl_parity_adaptive_kl():
    # verl apply_kl_penalty: kld = k1(old, ref)·mask; current_kl = mean_rows(masked_mean(kld, axis=−1));
    # AdaptiveKLController.update(current_kl, n_steps=batch_size): e = clip(kl/target − 1, ±0.2),
    # value *= 1 + e·n/horizon. verl defaults kl_coef 0.001, target_kl 0.1, horizon 10000.
    # rows (token k1): [0.05, 0.15] → 0.1; [0.2, 0.4 (masked)] → 0.2; [0.3, 0.3] → 0.3 → current_kl 0.2
    # e = clip(0.2/0.1 − 1 = 1, ±0.2) = 0.2 → 0.001·(1 + 0.2·3/10000) = 0.00100006
    diffs = [[[0.05, 0.15], [0.2, 0.4], [0.3, 0.3]]]
    mask = torch.tensor([[[1, 1], [1, 0], [1, 1]]])
    verl = build("schedule", "adaptive_kl", init=0.001, target=0.1, horizon=10000.0, level="token_mean")
    got = verl(info_for(2), _kl_batch(diffs, mask=mask))
    print(f"verl parity adaptive_kl: |Δ| {abs(got - 0.001 * (1 + 0.2 * 3 / 10000)):.2e}")
    assert got == pytest.approx(0.001 * (1 + 0.2 * 3 / 10000), rel=1e-12)
    # TRL ≤ 0.11 PPOTrainer: objective/kl = mean_rows Σ_t (logp − ref)·mask = (0.2 + 0.2 + 0.6)/3 = 1/3;
    # kl_ctl.update(1/3, batch_size=3) with init 0.2, target 6: e = clip(1/18 − 1, ±0.2) = −0.2
    # → 0.2·(1 − 0.2·3/10000) = 0.199988
    trl = build("schedule", "adaptive_kl")
    got = trl(info_for(2), _kl_batch(diffs, mask=mask))
    assert trl.last_kl == pytest.approx(1 / 3, rel=1e-6) and got == pytest.approx(
        0.2 * (1 - 0.2 * 3 / 10000), rel=1e-12
    )


def test_adaptive_kl_as_kl_penalty_coefficient():
    # rewards = [{ name = "kl_penalty", coef = { schedule = "adaptive_kl", target = 6.0, horizon = 10000 } }]
    scorer = build("reward", "kl_penalty", coef={"schedule": "adaptive_kl", "target": 6.0, "horizon": 10000})
    assert scorer.coef == 0.2 and type(scorer.schedules["coef"]).__name__ == "AdaptiveKL"
    ro = _kl_batch([[[4.0, 5.0], [6.0, 3.0]]])  # row sums 9, 9 → KL 9 → e = 0.2 → 0.2·(1 + 0.2·2/10000)
    # scored with β_t
    torch.testing.assert_close(scorer.score_rollout(ro, info_for(2)), torch.tensor([[-0.2 * 9, -0.2 * 9]]))
    logged = schedules.resolve([scorer], info_for(2), ro)
    assert scorer.coef == pytest.approx(0.2 * 1.00004) and logged == {"coef/kl_penalty.coef": scorer.coef}


# ---------------------------------------------------------------------------------------------- seq_mean_token_sum
VALUES = torch.tensor([[[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]]])  # [1,3,3]
MASK = torch.tensor([[[1, 1, 1], [1, 0, 0], [0, 0, 0]]], dtype=torch.bool)  # row 2 fully masked


def test_seq_mean_token_sum_by_hand():
    agg = build("aggregation", "seq_mean_token_sum")
    norm = agg.normalizer(MASK, info_for(3))
    assert norm == {"rows": torch.tensor(2)}
    # row sums [1+2+3 = 6, 4, (masked)] over 2 rows with tokens → 5.0
    values = VALUES.clone().requires_grad_(True)
    loss = agg.reduce(values, MASK, norm)
    assert loss.item() == pytest.approx(5.0)
    loss.backward()
    torch.testing.assert_close(values.grad, MASK.float() / 2)  # every loss token weighs 1/#rows
    # a row value counts once per loss token: [2, 5, 9] → (2·3 + 5·1)/2 = 5.5
    assert agg.reduce(torch.tensor([[2.0, 5.0, 9.0]]), MASK, norm).item() == pytest.approx(5.5)
    # micro-batch shares with the whole-batch normaliser add up; all masked → 0
    assert (
        agg.reduce(VALUES[:, :1], MASK[:, :1], norm) + agg.reduce(VALUES[:, 1:], MASK[:, 1:], norm)
    ).item() == pytest.approx(5.0)
    empty = torch.zeros_like(MASK)
    assert agg.reduce(VALUES, empty, agg.normalizer(empty, info_for(3))).item() == 0.0


def test_verl_parity_seq_mean_token_sum():
    # verl agg_loss(loss_mat, loss_mask, "seq-mean-token-sum"): seq_losses = Σ_t loss·mask;
    # seq_mask = (Σ_t mask > 0); loss = masked_sum(seq_losses, seq_mask) / seq_mask.sum() · dp_size(1).
    # Hand case: VALUES/MASK → seq_losses [6, 4, 0], seq_mask [1, 1, 0] → 10/2 = 5.0 (above). Random:
    g = torch.Generator().manual_seed(7)
    loss_mat = torch.randn(2, 5, 8, generator=g)
    lengths = torch.randint(0, 9, (2, 5), generator=g)
    lengths[1, 2] = 0  # a row without loss tokens: not counted by either
    mask = torch.arange(8)[None, None] < lengths[..., None]  # [2,5,8] (rows of length 0 included)
    seq_losses = (loss_mat * mask).sum(-1)  # [2,5]
    seq_mask = (mask.sum(-1) > 0).float()  # [2,5]
    verl = (seq_losses * seq_mask).sum() / seq_mask.sum()
    agg = build("aggregation", "seq_mean_token_sum")
    ours = agg.reduce(loss_mat, mask, agg.normalizer(mask, info_for(8)))
    print(f"verl parity seq_mean_token_sum: |Δ| {abs(ours - verl).item():.2e}")
    assert abs(ours - verl).item() < 1e-6 and (lengths == 0).any()
    # seq-mean-token-mean differs (guards that the test can tell them apart)
    assert (
        abs(build("aggregation", "seq_mean_token_mean").reduce(loss_mat, mask, {"rows": seq_mask.sum().long()}) - verl)
        > 1e-3
    )
