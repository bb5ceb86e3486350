"""GXPO (spec 55): retention scale, the shutoff gate and the 3-pass update, worked by hand on
quadratics; closure-call counts; fallback, non-finite and resume behaviour; fewer outer steps than
plain SGD / AdamW on an ill-conditioned quadratic; one end-to-end run through the trainer.

Conventions: L(θ) = ½ Σ h·θ², so g = h·θ; SGD with lr η moves θ ← θ − η·g; S_K(r) = Σ_{k<K} r^k.
"""

from __future__ import annotations

import copy
import io
import json
import math

import pytest
import torch

from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.run import Run
from groupwise.updates._base import OptimizerSnapshot
from groupwise.updates.gxpo import GXPOGate, gxpo_retention_scale

SGD = dict(optimizer="sgd", lr=0.5, weight_decay=0.0, max_grad_norm=0.0, gate_warmup=0)


def quadratic(theta, h, calls=None, factor=lambda: 1.0):
    """closure(): backward of ½ Σ factor·h·θ² at the current θ; records θ per call in `calls`."""

    def closure():
        if calls is not None:
            calls.append(theta.detach().clone())
        loss = 0.5 * factor() * (h * theta**2).sum()
        loss.backward()
        return loss.detach()

    return closure


def updater(theta, total_steps=100, **kw):
    upd = build("update", "gxpo", **kw)
    upd.bind([theta], total_steps)
    return upd


# ---------------------------------------------------------------------------------------------- retention scale
def test_retention_scale_by_hand():
    g0 = torch.tensor([1.0, 1e-9, 1.0, 1.0, 1.0, 1.0, 0.0])
    g1 = torch.tensor([0.5, 1.0, 5.0, -1.0, -5.0, 1.0, 0.0])
    r, scale, active = gxpo_retention_scale(g0, g1, K=5, delta=1e-8, c0=1.0, c1=1.0)
    # 0: r = 0.5 → S5 = 1+.5+.25+.125+.0625 = 1.9375, S2 = 1.5 → 1.2916667
    # 1: |g0| = 1e-9 ≤ δ → inactive → r = 1, scale 1
    # 2: r = 5 → clipped to 3 → S5 = 1+3+9+27+81 = 121, S2 = 4 → 30.25 → clamped to K/2+1 = 3.5
    # 3: r = −1 → S2 = 0 ≤ δ → scale 1
    # 4: r = −5 → clipped to −2 → S5 = 1−2+4−8+16 = 11, S2 = −1 → −11 → clamped up to 1
    # 5: r = 1 → S5/S2 = 5/2 = 2.5
    # 6: 0/0 = NaN, inactive → r = 1, scale 1 (never NaN)
    torch.testing.assert_close(r, torch.tensor([0.5, 1.0, 3.0, -1.0, -2.0, 1.0, 1.0]))
    torch.testing.assert_close(scale, torch.tensor([1.9375 / 1.5, 1.0, 3.5, 1.0, 1.0, 2.5, 1.0]))
    assert active.tolist() == [True, False, True, True, True, True, False]


def test_retention_scale_uses_clip_factors_and_K():
    # c0 = 1, c1 = 0.5: r = 0.5·1/(1·1) = 0.5 → 1.2916667 even though the raw g1 equals g0
    _, scale, _ = gxpo_retention_scale(torch.tensor([1.0]), torch.tensor([1.0]), K=5, delta=1e-8, c1=0.5)
    torch.testing.assert_close(scale, torch.tensor([1.9375 / 1.5]))
    # K = 10, r = 0.5: S10 = (1 − 0.5^10)/0.5 = 1.998046875, / 1.5 = 1.33203125 (clamp 6 not reached)
    _, scale, _ = gxpo_retention_scale(torch.tensor([1.0]), torch.tensor([0.5]), K=10, delta=1e-8)
    torch.testing.assert_close(scale, torch.tensor([1.33203125]))


# ---------------------------------------------------------------------------------------------- the 3-pass step
def test_quadratic_alpha_one_is_exact_five_step_gd():
    theta, calls = torch.tensor([1.0], requires_grad=True), []
    upd = updater(theta, **SGD, alpha=1.0)
    out = upd.step(quadratic(theta, torch.ones(1), calls))
    # θ0 = 1, g0 = 1 → θ1 = 0.5; g1 = 0.5 → θ2 = 0.25; r = 0.5, scale 1.2916667
    # θ̃ = 1 + 1·1.2916667·(0.25 − 1) = 0.03125 = 0.5⁵ (five GD steps); corrective: 0.03125·(1 − 0.5)
    assert [float(c) for c in calls] == pytest.approx([1.0, 0.5, 0.03125])
    assert float(theta.detach()) == pytest.approx(0.015625)
    assert out["backward_passes"] == 3 and out["gxpo_enabled"] == 1.0
    assert out["loss"] == pytest.approx(0.5) and out["grad_norm"] == pytest.approx(1.0)  # both at θ0
    assert out["gxpo_scale_mean"] == pytest.approx(1.9375 / 1.5) and out["gxpo_active_frac"] == 1.0


def test_quadratic_alpha_half_and_corrective_step():
    theta, calls = torch.tensor([1.0], requires_grad=True), []
    upd = updater(theta, **SGD, alpha=0.5)
    upd.step(quadratic(theta, torch.ones(1), calls))
    # θ̃ = 1 + 0.5·1.2916667·(−0.75) = 0.515625; corrective step θ̃ − 0.5·θ̃ = 0.2578125 (plain SGD: 0.5)
    assert float(calls[2]) == pytest.approx(0.515625)
    assert float(theta.detach()) == pytest.approx(0.2578125)


def test_min_effective_multiplier_floors_alpha_scale():
    theta, calls = torch.tensor([1.0], requires_grad=True), []
    upd = updater(theta, **SGD, alpha=0.5, min_effective_multiplier=2.0)
    upd.step(quadratic(theta, torch.ones(1), calls))
    # α·scale = 0.6458 < 2 → 2: θ̃ = 1 + 2·(−0.75) = −0.5
    assert float(calls[2]) == pytest.approx(-0.5)


@pytest.mark.parametrize("mode, expected", [("transactional", 0.1125), ("transactional_fast_state", -0.5175)])
def test_state_mode_with_momentum(mode, expected):
    theta, calls = torch.tensor([1.0], requires_grad=True), []
    upd = updater(theta, **SGD, momentum=0.9, state_mode=mode)
    upd.step(quadratic(theta, torch.ones(1), calls))
    # probe 1: buf = g0 = 1, θ1 = 1 − 0.5 = 0.5; probe 2: g1 = 0.5, buf = 0.9·1 + 0.5 = 1.4, θ2 = 0.5 − 0.7 = −0.2
    # r = g1/g0 = 0.5 → scale 1.2916667; θ̃ = 1 + 0.5·1.2916667·(−1.2) = 0.225
    # transactional: state rolled back to θ0's (no buffer) → buf = 0.225, θ = 0.225 − 0.1125 = 0.1125
    # fast state:    buf = 0.9·1.4 + 0.225 = 1.485 → θ = 0.225 − 0.7425 = −0.5175
    assert float(calls[2]) == pytest.approx(0.225)
    assert float(theta.detach()) == pytest.approx(expected)
    buf = upd.torch_optimizer.state[theta]["momentum_buffer"]
    assert float(buf) == pytest.approx(0.225 if mode == "transactional" else 1.485)


def test_adamw_direction_space_by_hand():
    theta, calls = torch.tensor([1.0], requires_grad=True), []
    b1, b2, lr = 0.9, 0.999, 0.1
    upd = updater(
        theta,
        optimizer="adamw",
        lr=lr,
        betas=(b1, b2),
        weight_decay=0.0,
        eps=0.0,
        max_grad_norm=0.0,
        gate_warmup=0,
        fused=False,
        retention_space="adamw_direction",
    )
    upd.step(quadratic(theta, torch.ones(1), calls))
    # Adam's first step is lr·m̂/√v̂ = lr·g/|g|: d0 = 1, θ1 = 0.9; g1 = 0.9:
    m = b1 * (1 - b1) * 1.0 + (1 - b1) * 0.9  # 0.18
    v = b2 * (1 - b2) * 1.0 + (1 - b2) * 0.81  # 0.001809
    d1 = (m / (1 - b1**2)) / math.sqrt(v / (1 - b2**2))  # 0.947368 / 0.951290 = 0.995877 (grad space: r = 0.9)
    scale = sum(d1**k for k in range(5)) / (1 + d1)  # S5/S2 = 2.4897
    # θ2 = 0.9 − 0.1·d1; θ̃ = 1 + 0.5·scale·(θ2 − 1)
    assert float(calls[2]) == pytest.approx(1 + 0.5 * scale * (0.9 - lr * d1 - 1.0), rel=1e-5)


def test_adamw_direction_removes_decoupled_weight_decay():
    # coordinate 1 has no gradient: AdamW only decays it, θ ← (1 − lr·wd)·θ, so its direction
    # d = (c·θ_t − θ_{t+1})/lr with c = 1 − lr·wd is 0 → inactive (without c it would be wd·θ = 0.1)
    theta = torch.tensor([1.0, 1.0], requires_grad=True)
    upd = updater(
        theta,
        optimizer="adamw",
        lr=0.1,
        weight_decay=0.1,
        max_grad_norm=0.0,
        gate_warmup=0,
        fused=False,
        retention_space="adamw_direction",
        delta=1e-5,
    )
    out = upd.step(quadratic(theta, torch.tensor([1.0, 0.0])))
    assert out["gxpo_active_frac"] == 0.5


# ---------------------------------------------------------------------------------------------- the gate
def test_gate_trips_on_spike_permanent():
    gate = GXPOGate(tau=3.0, window=10, patience=1, warmup=0)
    for step in range(10):
        z, tripped = gate.update(30.0, step)
        assert (z, tripped) == (0.0, False)  # window not full: no z-score yet
    z, tripped = gate.update(300.0, 10)
    # window: ten 30s, mean 30, std 0 → z = 270 / 1e-9 = 2.7e11
    assert tripped and z == pytest.approx(2.7e11)
    assert gate.enabled(10) and not gate.enabled(11) and not gate.enabled(1000)
    # a spike before the window is full is not judged: 3000 after (30, 40) with W = 10 → z = 0, armed
    early = GXPOGate(tau=3.0, window=10, patience=1, warmup=0)
    assert [early.update(H, s) for s, H in enumerate([30.0, 40.0, 3000.0])] == [(0.0, False)] * 3
    assert early.enabled(3)


def test_gate_temporary_rearms_with_kept_baseline():
    gate = GXPOGate(tau=3.0, window=10, patience=1, warmup=0, fallback_mode="temporary", fallback_window=5)
    for step, H in enumerate([30.0] * 10 + [300.0]):
        gate.update(H, step)
    # tripped at step 10 → off for steps 11..15, on again at 11 + 5 = 16
    assert [gate.enabled(s) for s in range(11, 17)] == [False] * 5 + [True]
    z, tripped = gate.update(30.0, 16)
    # baseline kept: nine 30s and the 300 → mean 57, deviations −27 (×9), 243 → var (9·729 + 59049)/10
    # = 6561, std 81 → z = (30 − 57)/81 = −1/3
    assert z == pytest.approx(-1 / 3) and not tripped and gate.enabled(17)


def test_gate_patience_and_warmup():
    def run(patience, warmup, values):
        gate = GXPOGate(tau=2.5, window=10, patience=patience, warmup=warmup)
        out = [gate.update(H, s) for s, H in enumerate([30.0] * 10 + values)]
        return [round(z, 6) for z, _ in out[10:]], any(t for _, t in out)

    # 300 vs ten 30s: z = 2.7e11; then 300 vs (nine 30s, 300): mean 57, std 81, z = 243/81 = 3.0
    # then 300 vs (eight 30s, two 300s): mean 84, var (8·900 + 2·90000)/10 − 84² = 11664, std 108, z = 216/108 = 2.0
    zs, tripped = run(patience=2, warmup=0, values=[300.0, 300.0])
    assert zs[1] == pytest.approx(3.0) and tripped  # two consecutive z ≥ 2.5
    zs, tripped = run(patience=3, warmup=0, values=[300.0, 300.0, 300.0])
    assert zs[2] == pytest.approx(2.0) and not tripped  # the third z (2.0) breaks the streak
    _, tripped = run(patience=1, warmup=11, values=[300.0])
    assert not tripped  # the spike is at step 10 < warm-up 11: it feeds the window but cannot trip


def test_gate_statistic_mode():
    assert GXPOGate(mode="trajectory_aware").statistic(g0_norm=1.0, corrective_norm=2.0) == 2.0
    assert GXPOGate(mode="legacy_g0").statistic(g0_norm=1.0, corrective_norm=2.0) == 1.0


def test_closure_calls_three_per_step_then_one_after_the_spike_trips_the_gate():
    theta = torch.ones(4, requires_grad=True)
    step_no, calls = [0], []
    spike = lambda: 1000.0 if step_no[0] == 6 else 1.0  # noqa: E731  gradient spike at outer step 6
    upd = updater(
        theta,
        optimizer="sgd",
        lr=0.05,
        weight_decay=0.0,
        max_grad_norm=1.0,
        window=3,
        patience=1,
        gate_warmup=0,
        tau=3.0,
    )
    passes = []
    for step_no[0] in range(10):
        n = len(calls)
        out = upd.step(quadratic(theta, torch.ones(4), calls, spike))
        passes.append(len(calls) - n)
        assert out["backward_passes"] == passes[-1]
    # steps 0..6 extrapolate (3 closure calls); the spike's corrective norm (×1000) has z ≫ 3 vs the
    # last 3 steps → the gate is off from step 7: exactly one closure call per step
    print("closure calls per step:", passes)
    assert passes == [3] * 7 + [1] * 3
    assert not upd.gate.enabled(7)


# ---------------------------------------------------------------------------------------------- fallback, non-finite
def test_tiny_gradient_falls_back_to_one_plain_step():
    theta, calls = torch.tensor([1e-10], requires_grad=True), []
    out = updater(theta, **SGD).step(quadratic(theta, torch.ones(1), calls))
    # ‖g0‖ = 1e-10 ≤ 1e-8 → one closure call, plain step θ − 0.5·θ
    assert len(calls) == 1 and out["gxpo_enabled"] == 0.0 and out["backward_passes"] == 1
    assert float(theta.detach()) == pytest.approx(5e-11)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # a skipped first step, as TorchUpdater
@pytest.mark.parametrize("bad_call", [1, 2, 3])
def test_nonfinite_pass_skips_and_restores(bad_call):
    theta, calls = torch.tensor([1.0], requires_grad=True), []
    upd = updater(theta, **SGD, momentum=0.9)
    factor = lambda: float("nan") if len(calls) == bad_call else 1.0  # noqa: E731
    out = upd.step(quadratic(theta, torch.ones(1), calls, factor))
    # the bad pass ends the step; weights and momentum are θ0's (1.0, no buffer); counted as skipped
    assert len(calls) == bad_call and out["backward_passes"] == bad_call
    assert out["skipped"] == 1.0 and out["nonfinite"] == 1.0 and upd.skipped == 1
    assert float(theta.detach()) == 1.0 and "momentum_buffer" not in upd.torch_optimizer.state.get(theta, {})
    assert upd.scheduler.last_epoch == 1  # the schedule still advances once
    out = upd.step(quadratic(theta, torch.ones(1), calls))
    assert out["skipped"] == 0.0 and out["backward_passes"] == 3


def test_scheduler_advances_once_per_outer_step():
    theta = torch.tensor([1.0], requires_grad=True)
    upd = updater(theta, total_steps=4, **{**SGD, "schedule": "linear"})
    lrs = [upd.step(quadratic(theta, torch.ones(1)))["lr"] for _ in range(4)]
    assert lrs == pytest.approx([0.5, 0.375, 0.25, 0.125])  # 0.5·(1 − s/4): one decay per 3-pass step


def test_optimizer_snapshot_restores_and_drops_new_state():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([p], lr=0.1)
    empty = OptimizerSnapshot(opt)
    p.grad = torch.tensor([1.0, 1.0])
    opt.step()
    saved = copy.deepcopy(opt.state[p])
    snap = OptimizerSnapshot(opt)
    for _ in range(2):
        opt.step()
    assert float(opt.state[p]["step"]) == 3
    snap.restore()
    for k, v in saved.items():
        torch.testing.assert_close(opt.state[p][k], v)
    empty.restore()
    assert p not in opt.state  # back to lazy: the next step initialises state afresh


def test_bad_config_is_named():
    with pytest.raises(ConfigError, match="optimizer"):
        build("update", "gxpo", optimizer="lion")
    with pytest.raises(ConfigError, match="K >= 2"):
        build("update", "gxpo", K=1)
    with pytest.raises(ConfigError, match="gate_mode"):
        build("update", "gxpo", gate_mode="ema")
    with pytest.raises(ConfigError, match="state_mode"):
        build("update", "gxpo", state_mode="lazy")


# ---------------------------------------------------------------------------------------------- behaviour, resume
def steps_to_target(name, h, target, lr, max_steps=2000, **kw):
    theta = torch.ones(len(h), requires_grad=True)
    upd = build("update", name, lr=lr, max_grad_norm=0.0, **kw)
    upd.bind([theta], max_steps)
    for step in range(1, max_steps + 1):
        upd.step(quadratic(theta, h))
        if float(0.5 * (h * theta.detach() ** 2).sum()) < target:
            return step
    return max_steps


def test_fewer_outer_steps_than_plain_sgd_and_adamw_on_ill_conditioned_quadratic():
    h = torch.tensor([1.0, 0.1, 0.01])  # condition number 100
    sgd = steps_to_target("sgd", h, 1e-4, lr=1.0)
    gx = steps_to_target("gxpo", h, 1e-4, lr=1.0, optimizer="sgd", weight_decay=0.0)
    adam = steps_to_target("adamw", h, 1e-4, lr=0.02, betas=(0.9, 0.99))
    gx_adam = steps_to_target("gxpo", h, 1e-4, lr=0.02, optimizer="adamw", betas=(0.9, 0.99), weight_decay=0.0)
    print(
        f"outer steps to loss < 1e-4: sgd {sgd}, gxpo(sgd) {gx} ({sgd / gx:.2f}x, backward "
        f"passes {3 * gx} vs {sgd}); adamw {adam}, gxpo(adamw) {gx_adam} ({adam / gx_adam:.2f}x)"
    )
    assert gx * 2 < sgd
    assert gx_adam < adam


def _run(upd, theta, steps, start=0):
    h = torch.tensor([1.0, 0.3, 0.05, 0.01])
    factor = {"s": 0}
    outs = []
    for s in range(start, start + steps):
        factor["s"] = s
        outs.append(upd.step(quadratic(theta, h, factor=lambda: 50.0 if factor["s"] == 7 else 1.0)))
    return outs


def test_state_round_trip_equals_uninterrupted():
    kw = dict(
        optimizer="adamw",
        lr=0.05,
        betas=(0.9, 0.99),
        weight_decay=0.01,
        warmup_steps=2,
        schedule="cosine",
        window=3,
        patience=1,
        gate_warmup=1,
        tau=3.0,
    )
    theta = torch.tensor([1.0, -1.0, 2.0, 0.5], requires_grad=True)
    straight = _run(updater(theta, total_steps=12, **kw), theta, 12)
    theta_a = torch.tensor([1.0, -1.0, 2.0, 0.5], requires_grad=True)
    first = updater(theta_a, total_steps=12, **kw)
    head = _run(first, theta_a, 5)
    buf = io.BytesIO()
    torch.save({"theta": theta_a.detach(), "updater": first.state_dict()}, buf)  # as a checkpoint does
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    theta_b = state["theta"].clone().requires_grad_(True)
    second = updater(theta_b, total_steps=12, **kw)
    second.load_state_dict(state["updater"])
    tail = _run(second, theta_b, 7, start=5)
    assert torch.equal(theta_b.detach(), theta.detach())
    assert json.dumps(head + tail) == json.dumps(straight)  # every metric, bit for bit
    # the spike at step 7 tripped the gate across the resume
    assert [o["backward_passes"] for o in straight].count(1.0) > 0


# ---------------------------------------------------------------------------------------------- end to end
def test_trainer_end_to_end(tmp_path):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    cfg, _ = load_config(
        None,
        [
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "eval.size=0",
            "threads=1",
            "train.steps=2",
            'update={name="gxpo", lr=1e-3}',
            f'out="{tmp_path}"',
        ],
    )
    Run(Trainer(build(cfg))).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["backward_passes"] == 3 and row["gxpo_enabled"] == 1.0
        assert row["loss"] is not None and math.isfinite(row["loss"])
        assert 1.0 <= row["gxpo_scale_mean"] <= 3.5 and 0.0 < row["gxpo_active_frac"] <= 1.0
