"""DISA (spec 09): the importance-sampled log Z estimator and the trajectory-balance residual by hand
(the spec's unit test), the clipped weight and the clamp of ℓ̄_θ, the frozen anchor (table, regressor,
errors), micro-batch invariance, the phase (q = reference identity, a frozen-role proposal, the
tempered log-probs, the artifact saved and loaded on a rerun) and composition with grpo and sign."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from helpers import check_micro_batching, info_for, make_rollout, objective_for, rollout_from, train_recorded
from test_trainer import make_trainer

from groupwise.errors import ConfigError
from groupwise.losses.disa import DISA, LogZRegressor, estimate_logZ, is_ess, r_squared, tb_loss, tb_residual
from groupwise.phases import PhaseContext, load_output
from groupwise.phases.disa_logz import DisaLogZ
from groupwise.policy.forward import tempered_logp
from groupwise.run import Run
from groupwise.types import Need, Request, StepInfo

Z = 1.721692  # the spec's log Ẑ (below)


# ---------------------------------------------------------------------------------------------- the estimator
def test_is_estimator_by_hand_the_spec_case():
    # β = 2, r̂ = [1, 0, 1], ℓ̄_ref = [−1, −2, −1.5], ℓ̄_q = [−1.2, −1.0, −1.5]
    # log w = 2·r̂ + ℓ̄_ref − ℓ̄_q = [2 − 1 + 1.2, 0 − 2 + 1, 2 − 1.5 + 1.5] = [2.2, −1.0, 2.0]
    # log Ẑ = log((e^2.2 + e^−1 + e^2) / 3) = log(16.781948 / 3) = 1.721692
    r_hat, lref, lq = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([-1.0, -2.0, -1.5]), torch.tensor([-1.2, -1.0, -1.5])
    logZ = estimate_logZ(r_hat, lref, lq, beta=2.0)
    assert logZ.shape == () and float(logZ) == pytest.approx(1.7216916, abs=1e-6)
    # ESS = (Σw)² / Σw² = 16.781948² / (e^4.4 + e^−2 + e^4) = 281.6338 / 136.1843 = 2.068034
    assert float(is_ess(2.0 * r_hat + lref - lq, torch.ones(3, dtype=torch.bool))) == pytest.approx(2.0680336, abs=1e-5)
    # sanity (spec): q = ref gives log mean exp(β r̂) = log((e² + 1 + e²) / 3) = log(5.259371) = 1.660011
    assert float(estimate_logZ(r_hat, lref, lref, beta=2.0)) == pytest.approx(
        math.log((2 * math.exp(2) + 1) / 3), abs=1e-6
    )


def test_is_estimator_batched_with_invalid_proposals():
    # prompt 0: the spec case; prompt 1: r̂ = [1, 0, ·] with the third proposal invalid (no reward), q = ref
    #   → log((e² + e⁰) / 2) = log(4.194528) = 1.433781 (M counts valid proposals only); prompt 2: none valid → NaN
    r_hat = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 5.0], [1.0, 1.0, 1.0]])  # [P,M]
    lref = torch.tensor([[-1.0, -2.0, -1.5], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    lq = torch.tensor([[-1.2, -1.0, -1.5], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    valid = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    logZ = estimate_logZ(r_hat, lref, lq, 2.0, valid)  # [P]
    torch.testing.assert_close(logZ[:2], torch.tensor([1.7216916, 1.4337808]), atol=1e-6, rtol=0)
    assert torch.isnan(logZ[2])
    # ESS of prompt 1: (e² + 1)² / (e⁴ + 1) = 70.376 / 55.598 = 1.265802; no valid proposal: 0
    ess = is_ess(2.0 * r_hat + lref - lq, valid)
    assert float(ess[1]) == pytest.approx((math.exp(2) + 1) ** 2 / (math.exp(4) + 1), abs=1e-5) and float(ess[2]) == 0.0


# ---------------------------------------------------------------------------------------------- the residual
def test_residual_loss_and_gradient_by_hand_no_gradient_to_logZ():
    # δ = 1.721692 + (−1.1) − 2·1 − (−1) = −0.378308;  L = w·δ² = 0.143117 (w = 1);  dL/dℓ̄_θ = 2δ = −0.756616
    logZ = torch.tensor([Z], requires_grad=True)
    lp_bar = torch.tensor([[-1.1]], requires_grad=True)
    delta = tb_residual(logZ, lp_bar, torch.tensor([[-1.0]]), torch.tensor([[1.0]]), beta=2.0)
    assert float(delta.detach()) == pytest.approx(-0.378308, abs=1e-6)
    loss = tb_loss(logZ, lp_bar, torch.tensor([[-1.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), beta=2.0)
    assert float(loss.detach()) == pytest.approx(0.143117, abs=1e-6)
    loss.backward()
    assert float(lp_bar.grad) == pytest.approx(-0.756616, abs=1e-6)
    assert logZ.grad is None  # the anchor is frozen: detached inside the residual


def _term(beta=2.0, table=(Z,), **kw) -> DISA:
    term = DISA(beta=beta, **kw)
    term.use_artifact("logz", {"table": torch.tensor(table), "beta": beta, "regressor": None})
    return term


def test_the_term_through_the_objective_by_hand():
    # one group, two rows, on-policy (w = 1), β = 2, log Z = 1.721692, seq_mean_token_mean (mean over rows)
    # row 0: logp [−1.0, −1.2] → ℓ̄_θ = −1.1, ℓ̄_ref = −1, r̂ = 1 → δ = −0.378308, δ² = 0.143117
    # row 1: one token logp −2.0 (the padding's junk must not count), ℓ̄_ref = −1.5, r̂ = −1
    #        → δ = 1.721692 − 2 + 2 + 1.5 = 3.221692, δ² = 10.379299
    # L = (0.143117 + 10.379299) / 2 = 5.261208
    # dL/dlogp_t = (1/2 rows)·2δ·(1/|y|): row 0: 0.5·2·(−0.378308)·0.5 = −0.189154 each; row 1: 3.221692; padding 0
    logp = torch.tensor([[[-1.0, -1.2], [-2.0, 7.0]]], requires_grad=True)  # [1,2,2]
    mask = torch.tensor([[[True, True], [True, False]]])
    ro = rollout_from(
        logp.detach().clone(), torch.tensor([[1.0, -1.0]]), mask, logp_ref=torch.tensor([[[-1.0, -1.0], [-1.5, -30.0]]])
    )
    obj = objective_for([_term()], "seq_mean_token_mean")
    info = info_for(2)
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    assert float(loss) == pytest.approx(5.261208, abs=1e-5)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[[-0.189154, -0.189154], [3.221692, 0.0]]]), atol=1e-5, rtol=0)
    stats = obj.pop_stats()
    assert stats["disa/delta"] == pytest.approx((-0.378308 + 3.221692) / 2, abs=1e-5) and stats["disa/w"] == 1.0
    assert (
        stats["disa/logz"] == pytest.approx(Z, abs=1e-6) and stats["disa/clamp_low"] == stats["disa/clamp_high"] == 0.0
    )


@pytest.mark.parametrize("clamp", [True, False])
def test_clipped_weight_and_the_clamp_of_the_mean_logp(clamp):
    # logp = [−1.0, −1.2] (ℓ̄_θ = −1.1), ℓ̄_ref = −1, r̂ = 1, β = 2, log Z = 1.721692
    # high side: logp_old = logp − 0.5 → Σ(logp − logp_old) = 1 → w = clip(e, 0.8, 1.28) = 1.28; ℓ̄_old = −1.6,
    #   bounds [−1.6 + log 0.8, −1.6 + log 1.28] = [−1.823144, −1.353140]: ℓ̄_θ = −1.1 is above
    #   clamp: ℓ̄ = −1.353140, δ = −0.631448, L = 1.28·δ² = 0.510370, no gradient (clamped)
    #   no clamp: δ = −0.378308, L = 1.28·0.143117 = 0.183190, dL/dlogp_t = 1.28·2δ/2 = −0.484234
    # low side: logp_old = logp + 0.5 → w = clip(e^−1, 0.8, 1.28) = 0.8; bounds [−0.823144, −0.353140]
    #   clamp: ℓ̄ = −0.823144, δ = −0.101452, L = 0.8·δ² = 0.008234;  no clamp: L = 0.8·0.143117 = 0.114494
    # inside: logp_old = logp − 0.05 → Σ = 0.1 → w = e^0.1 = 1.105171 (a sequence sum, not a mean: e^0.05 would be
    #   1.051271); ℓ̄_old = −1.15, bounds [−1.373144, −0.903140] hold −1.1: L = 1.105171·0.143117 = 0.158168 either way
    logp0 = torch.tensor([[[-1.0, -1.2]]])
    cases = {
        "high": (logp0 - 0.5, 0.510370 if clamp else 0.183190),
        "low": (logp0 + 0.5, 0.008234 if clamp else 0.114494),
        "inside": (logp0 - 0.05, 0.158168),
    }
    for side, (logp_old, expected) in cases.items():
        logp = logp0.clone().requires_grad_(True)
        ro = rollout_from(logp_old, torch.tensor([[1.0]]), logp_ref=torch.full((1, 1, 2), -1.0))
        term = _term(eps_low=0.2, eps_high=0.28, clamp_logp=clamp)
        values = term(ro, {"logp": logp}, info_for(2))  # [1,1]
        assert float(values) == pytest.approx(expected, abs=1e-5), side
        (grad,) = torch.autograd.grad(values.sum(), logp)
        if side == "inside":  # dL/dlogp_t = w·2δ/2 = −0.418096
            torch.testing.assert_close(grad, torch.full((1, 1, 2), -0.418096), atol=1e-5, rtol=0)
            continue
        if clamp:
            assert (grad == 0).all(), side  # outside the clamp bounds: no gradient
        elif side == "high":
            torch.testing.assert_close(grad, torch.full((1, 1, 2), -0.484234), atol=1e-5, rtol=0)
        stats = term.stats(ro, {"logp": logp})
        assert float(stats[f"disa/clamp_{side}"]) == 1.0 and float(stats["disa/w"]) == pytest.approx(
            1.28 if side == "high" else 0.8
        )


def test_edge_rows_constant_group_nan_advantage_masked_row():
    # a constant group (r̂ = 0): δ = log Z + ℓ̄_θ − ℓ̄_ref, finite; a NaN advantage or a fully masked row:
    # exactly 0 and no gradient
    logp = torch.tensor([[[-1.0, -1.0], [-2.0, -2.0], [-1.0, -1.0]]], requires_grad=True)  # [1,3,2]
    mask = torch.tensor([[[True, True], [True, True], [False, False]]])
    ro = rollout_from(
        logp.detach().clone(), torch.tensor([[0.0, float("nan"), 0.0]]), mask, logp_ref=torch.full((1, 3, 2), -1.5)
    )
    values = _term()(ro, {"logp": logp}, info_for(2))  # [1,3]
    # row 0: δ = 1.721692 − 1 + 1.5 = 2.221692, δ² = 4.935915
    torch.testing.assert_close(values, torch.tensor([[2.221692**2, 0.0, 0.0]]), atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad(values.sum(), logp)
    assert (grad[0, 1:] == 0).all() and (grad[0, 0] != 0).all()


def test_the_anchor_table_regressor_and_refusals():
    # prompt ids 0 and 2: table values; prompt 1 has NaN (not estimated):
    # the regressor's prediction from hidden(1) at t = 0
    reg = LogZRegressor(3, 4)
    emb = torch.tensor([[0.5, -1.0, 2.0]])
    artifact = {
        "table": torch.tensor([0.7, float("nan"), -0.3]),
        "beta": 15.0,
        "regressor": {"state": reg.state_dict(), "embed_dim": 3, "hidden": 4, "layer": 1},
    }
    ro = make_rollout(3, 2, 4, seed=0, awkward=False)
    hidden = torch.zeros(3, 2, 4, 3)
    hidden[1, :, 0] = emb
    ro.set_extra(Need("hidden(1)", model="ref").key, hidden, "token")
    term = DISA(use_regressor=True)
    term.use_artifact("logz", artifact)
    with torch.no_grad():
        expected = float(reg(emb))
    torch.testing.assert_close(term._anchor(ro), torch.tensor([[0.7, 0.7], [expected, expected], [-0.3, -0.3]]))
    plain = DISA()
    plain.use_artifact("logz", artifact)
    with pytest.raises(ValueError, match=r"prompt ids \[1\] have no log Z in the table"):
        plain._anchor(ro)
    with pytest.raises(ConfigError, match="estimated log Z for beta=15.0"):
        DISA(beta=2.0).use_artifact("logz", artifact)
    with pytest.raises(ConfigError, match="holds no regressor"):
        DISA(use_regressor=True).use_artifact("logz", {**artifact, "regressor": None})
    with pytest.raises(ValueError, match="no log Z table: configure the offline phase disa_logz"):
        DISA()._anchor(ro)
    assert DISA(use_regressor=True, embed_layer=2).needs == (Need("logp", model="ref"), Need("hidden(2)", model="ref"))
    for bad in ({"beta": -1.0}, {"eps_low": 1.0}, {"embed_layer": -1}):
        with pytest.raises((ConfigError, ValueError)):
            DISA(**bad)


def test_regressor_fits_a_linear_target_and_r_squared_by_hand():
    # r² by hand: pred [1, 2, 2], target [1, 2, 3]: SS_res = 1, SS_tot = 2 → 0.5
    assert r_squared(torch.tensor([1.0, 2.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])) == pytest.approx(0.5)
    x = torch.linspace(-1, 1, 32)[:, None].expand(32, 2).clone()  # [32,2]
    target = 3.0 * x[:, 0] + 1.0  # [32]
    reg = LogZRegressor(2, 16)
    mse = reg.fit(x, target, steps=400, lr=1e-2, seed=0)
    assert mse < 1e-2 and r_squared(reg(x).detach(), target) > 0.99
    assert not any(p.requires_grad for p in reg.parameters())  # frozen after the fit


def test_loss_and_gradient_do_not_depend_on_micro_batching():
    ro = make_rollout(4, 3, 5, seed=2)
    obj = objective_for([_term(beta=15.0, table=tuple(float(v) for v in torch.randn(4)))], "seq_mean_token_mean")
    ro.logp_old = ro.logp_old + 0.05 * torch.randn(ro.logp_old.shape)  # off-policy: weights ≠ 1
    check_micro_batching(obj, ro, [[0], [1, 2], [3]], info_for(5))


# ---------------------------------------------------------------------------------------------- the phase
PHASE = ["data.train_size=8", "rollout.max_new_tokens=6"]


def _ctx(trainer, **kw) -> PhaseContext:
    return PhaseContext(
        trainer.policy,
        trainer.train_rows,
        trainer.parts.eval_rows,
        trainer.cfg.seed,
        trainer.prompts,
        lambda *a: 0.0,
        lambda s: None,
        score=trainer.score,
        advantage=lambda ro, info: trainer.estimator(ro, info),
        models=kw.pop("models", {}),
        max_new_tokens=trainer.cfg.rollout.max_new_tokens,
    )


def test_tempered_logp_matches_the_full_softmax_at_temperature(tmp_path):
    trainer = make_trainer(tmp_path, *PHASE)
    policy = trainer.policy
    roll = policy.generate(
        [Request(key=0, n=2, prompt=trainer.prompts("train", trainer.train_rows, 0))],
        {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 5},
        StepInfo(0, 0, 5),
    )
    with torch.no_grad():
        out = policy.forward(roll, ["logp", "last_hidden"])
        mask = roll.mask
        torch.testing.assert_close(
            tempered_logp(policy.module, out["last_hidden"], roll.actions, mask, 1.0), out["logp"], atol=1e-5, rtol=0
        )
        # by hand at T = 2: the model's full logits on prompt + completion,
        # log_softmax(logits / 2) at the predicting positions
        prompt = list(roll.prompt_ids[0])
        for g in range(2):
            n = int(mask[0, g].sum())
            ids = torch.tensor([prompt + roll.actions[0, g, :n].tolist()])
            logits = policy.module(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + n].float()  # [n,V]
            want = torch.log_softmax(logits / 2.0, -1).gather(1, roll.actions[0, g, :n, None]).squeeze(1)  # [n]
            got = tempered_logp(policy.module, out["last_hidden"], roll.actions, mask, 2.0)[0, g, :n]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_phase_q_equals_reference_at_temperature_one_and_a_frozen_role_proposal(tmp_path):
    trainer = make_trainer(
        tmp_path,
        *PHASE,
        'objective.terms=["disa"]',
        'phases=[{name="disa_logz", samples=4}]',
        'roles.prop={frozen=true, model={path="default"}}',
    )
    # q = the reference at T = 1: ℓ̄_q is ℓ̄_ref itself, so log Z = log mean_j exp(β r̂_j) (note 4)
    phase = DisaLogZ(samples=4, temperature=1.0, beta=15.0)
    trainer.policy.eval()
    ctx = _ctx(trainer)
    art = phase(ctx)
    assert art["summary"]["prompts"] == 8 and art["summary"]["rows"] == 8 and art["summary"]["proposals"] == 32
    # rebuild proposals with the same seeds and check log Z = log mean exp(15·r̂) from their GRPO advantages
    units = phase._units(ctx)
    info = StepInfo(step=-3, seed=trainer.cfg.seed, max_new_tokens=6, phase="logz")
    with torch.no_grad():
        roll = trainer.policy.generate(
            [Request(key=rows[0], n=4, prompt=ids) for ids, rows in units],
            {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 6},
            info,
        )
        roll.meta = [trainer.train_rows[rows[0]] for _, rows in units]
        trainer.score(roll, info)
        adv = trainer.estimator(roll, info)  # [8,4]
    expected = torch.logsumexp(15.0 * adv.double(), -1) - math.log(4)  # [8]
    torch.testing.assert_close(art["table"].double(), expected, atol=1e-5, rtol=0)
    # a frozen role with the policy's weights as proposal at T = 1.2 gives the self-proposal's estimates exactly
    own = DisaLogZ(samples=4, temperature=1.2)(ctx)
    role = DisaLogZ(samples=4, temperature=1.2, proposal="prop")(_ctx(trainer, models=trainer.parts.frozen))
    torch.testing.assert_close(role["table"], own["table"], atol=1e-5, rtol=0)
    assert not torch.allclose(own["table"], art["table"])  # T = 1.2 proposals: other samples, importance-corrected
    with pytest.raises(ConfigError, match="proposal='nope' is not a frozen role"):
        DisaLogZ(proposal="nope")(ctx)
    # the regressor option: fitted on hidden(1) at the prompt's last position, R² reported, loadable by the term
    fitted = DisaLogZ(samples=4, temperature=1.0, regressor=True, steps=50, val_fraction=0.25)(ctx)
    assert {"r2_train", "r2_val", "regressor_mse"} <= set(fitted["summary"]) and fitted["regressor"]["layer"] == 1
    DISA(use_regressor=True).use_artifact("logz", fitted)


def test_a_run_saves_the_artifact_and_a_rerun_loads_it_instead_of_sampling(tmp_path, capsys, monkeypatch):
    with pytest.raises(ConfigError, match="needs the artifact 'logz', which no offline phase produces"):
        make_trainer(tmp_path / "none", *PHASE, 'objective.terms=["disa"]')
    args = [
        *PHASE,
        'objective.terms=["disa"]',
        'phases=[{name="disa_logz", samples=4}]',
        "train.steps=1",
        "eval.size=0",
    ]
    trainer = make_trainer(tmp_path, *args)
    summary = Run(trainer).train()
    saved = load_output(tmp_path / "phases" / "logz.pt")
    assert summary["phases"]["logz"]["prompts"] == 8 and saved["artifact"]["beta"] == 15.0
    torch.testing.assert_close(trainer.objective.terms[0]._table, saved["artifact"]["table"])
    (tmp_path / "summary.json").unlink()
    shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
    again = make_trainer(tmp_path, *args)
    monkeypatch.setattr(DisaLogZ, "__call__", lambda self, ctx: pytest.fail("the phase ran again"))
    Run(again).train()
    assert "done already" in capsys.readouterr().err
    torch.testing.assert_close(again.objective.terms[0]._table, saved["artifact"]["table"])
    assert json.loads((tmp_path / "summary.json").read_text())["phases"]["logz"]["prompts"] == 8


# ---------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("estimator", ["grpo", "sign"])
def test_composes_with_grpo_and_sign_advantages(tmp_path, estimator):
    rows, seen = train_recorded(
        tmp_path,
        "disa",
        *PHASE,
        f'advantage.estimator="{estimator}"',
        'phases=[{name="disa_logz", samples=4}]',
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
    )
    table = load_output(tmp_path / "phases" / "logz.pt")["artifact"]["table"]
    for row, batch in zip(rows, seen):
        members = batch.row_mask.any(-1)  # [B,G] rows with a loss token
        # the anchor's row mean, by lookup
        expected = table[batch.prompt_index][:, None].expand_as(members)[members].mean()
        assert row["disa/logz"] == pytest.approx(float(expected), abs=1e-5)
        assert row["disa/w"] == 1.0  # one update a rollout: on-policy, ratio 1
    if estimator == "sign":
        assert set(seen[0].advantages.unique().tolist()) <= {-1.0, 0.0, 1.0}
