"""PAIR (spec 03): the spec's numbers by hand (tclip, momentum, per-turn advantages, attention
ratios), the probe's fit and two-stage score, turn labels of the reach game, the ``attn(l)``
quantity against the model's own eager attention, and two-step runs with the probe phase under
``ppo_clip`` and ``gspo``."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, rollout_from, train_recorded

from groupwise.advantages.pair import PairAdvantage, pair_turn_advantages
from groupwise.errors import ConfigError
from groupwise.phases.pair_probe import PairProbePhase, auroc, turn_labels
from groupwise.registry import build
from groupwise.rewards.pair import (
    TURN_REWARD,
    PairProbe,
    PairReward,
    fit_logistic,
    momentum_rewards,
    pair_features,
    pair_turn_rewards,
    row_turn_features,
    tclip,
    turn_spans,
)
from groupwise.tasks.reach import format_row


def close(got, want, tol=1e-06):
    return torch.testing.assert_close(
        torch.as_tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), rtol=0, atol=tol
    )  # noqa: E731


sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731


def test_tclip_spec_numbers():
    # σ(logit(p)/2): logit(0.99) = 4.595120 → σ(2.297560) = 0.908675; logit(0.2) = −1.386294 → σ(−0.693147) = 1/3
    close(tclip(torch.tensor([0.99, 0.5, 0.2])), [0.908675, 0.5, 0.333333])
    close(tclip(torch.tensor([1e-9, 1.0])), [0.05, 0.95])  # clamped to [eps, 1 − eps]; p = 1 does not make inf


def test_momentum_spec_numbers_and_options():
    # t=1: logit(0.8) = 1.386294, +5·(0.8 − 0.5) = 1.5 → σ(2.886294) = 0.947165
    # t=2: logit(0.6) = 0.405465, +5·(0.6 − 0.65) = −0.25 → σ(0.155465) = 0.538788
    close(momentum_rewards(torch.tensor([0.5, 0.8, 0.6])), [0.5, 0.947165, 0.538788])
    # clip_negative: Δ_2 = max(0, −0.05) = 0 → r_2 = σ(logit 0.6) = 0.6
    close(momentum_rewards(torch.tensor([0.5, 0.8, 0.6]), clip_negative=True), [0.5, 0.947165, 0.6])
    # through tclip (T=2): raw x with σ(logit(x)/2) = s̃ is x = s̃²/(s̃² + (1−s̃)²): 0.8 → 16/17, 0.6 → 0.36/0.52
    close(pair_turn_rewards([0.5, 16 / 17, 0.36 / 0.52]), [0.5, 0.947165, 0.538788])
    close(pair_turn_rewards([0.5, 16 / 17, 0.36 / 0.52], momentum=False), [0.5, 0.8, 0.6])
    assert momentum_rewards(torch.zeros(0)).numel() == 0
    close(momentum_rewards(torch.tensor([0.7])), [0.7])  # one turn: r_0 = s̃_0


def test_turn_advantages_spec_numbers_and_constant_group():
    # totals [1.4, 0.6] → mean 1.0, population std 0.4 → adv [+1, −1]; centred turns [−0.1, +0.1], [+0.1, −0.1]
    close(pair_turn_advantages([[0.6, 0.8], [0.4, 0.2]]), [[0.9, 1.1], [-0.9, -1.1]])
    # equal totals: std 0 ≤ 1e-8 → only the mean is subtracted (adv 0); the turn parts stay
    close(pair_turn_advantages([[0.5, 0.5], [0.3, 0.7]]), [[0.0, 0.0], [-0.2, 0.2]])


def _turn_rollout(rewards, turns, valid=None):
    """B=1, G=2 rows of T=6 tokens: turns [0,2) and [3,5) (a hole at 2, padding at 5); ``turns`` [G][2] r_t."""
    T = 6
    mask = torch.tensor([[[1, 1, 1, 1, 1, 0]] * 2], dtype=torch.bool)  # [1,2,6]
    loss_mask = torch.tensor([[[1, 1, 0, 1, 1, 0]] * 2], dtype=torch.bool)  # [1,2,6] the env token at 2 is a hole
    ro = rollout_from(
        torch.zeros(1, 2, T), None, mask=mask, rewards=torch.tensor([rewards], dtype=torch.float32), loss_mask=loss_mask
    )
    if valid is not None:
        ro.group_valid = torch.tensor([valid])
    if turns is not None:
        ro.set_extra(TURN_REWARD, torch.tensor([turns]), "segment")  # [1,2,2] r_t of turn t
    return ro


def test_advantage_on_token_axis_holes_and_fallback():
    ro = _turn_rollout([1.4, 0.6], [[0.6, 0.8], [0.4, 0.2]])
    A = PairAdvantage()(ro, info_for(6))  # [1,2,6]
    # the hole and the padding: exactly 0
    close(A[0], [[0.9, 0.9, 0.0, 1.1, 1.1, 0.0], [-0.9, -0.9, 0.0, -1.1, -1.1, 0.0]])
    assert A.dtype == torch.float32 and (A[0, :, [2, 5]] == 0).all()
    # no pair_turn_reward extra: one turn per row with r_0 = R, so A = (R − mean)/std on every own token
    close(
        PairAdvantage()(_turn_rollout([1.4, 0.6], None), info_for(6))[0], [[1, 1, 0, 1, 1, 0], [-1, -1, 0, -1, -1, 0]]
    )
    # an invalid row: 0 everywhere, and the other row alone is a constant group → only its centred turns
    A = PairAdvantage()(_turn_rollout([1.4, float("nan")], [[0.6, 0.8], [0.4, 0.2]]), info_for(6))
    close(A[0], [[-0.1, -0.1, 0.0, 0.1, 0.1, 0.0], [0.0] * 6])
    with pytest.raises(ConfigError, match="eps"):
        PairAdvantage(eps=-1.0)


def test_attention_ratio_features_by_hand():
    # one layer, one head, S = 4; the turn is positions [2, 4): query rows 2 and 3
    # [1,4,4]
    A = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0], [0.5, 0.25, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4]]])
    hidden = [torch.arange(8.0).view(4, 2), torch.arange(8.0).view(4, 2) * 10]  # layers' [S,D]; the last one is read
    h, a = pair_features(hidden, [A], (2, 4))
    close(h, [60.0, 70.0])  # hidden_states[-1][e − 1]
    # max: (0.5 + 0.4)/2 = 0.45;  std (population over the 4 keys): row 2 √(0.125/4) = 0.176777,
    # row 3 √(0.05/4) = 0.111803 → 0.144290
    # prefix Σ_{k<2}: 0.75, 0.3 → 0.525;  self Σ_{2≤k<4}: 0.25, 0.7 → 0.475
    close(a, [0.45, (math.sqrt(0.125 / 4) + math.sqrt(0.05 / 4)) / 2, 0.525, 0.475])
    _, a0 = pair_features(hidden, [A], (0, 2))  # s = 0: prefix ratio 0; rows 0, 1 entirely on the turn's own keys
    close(a0[2:], [0.0, 1.0])
    # two layers: [max, std, prefix, self] per layer, concatenated
    two = pair_features(hidden, [A, A.flip(-1)], (2, 4))[1]
    assert two.shape == (8,) and torch.equal(two[:4], a)
    with pytest.raises(ValueError, match="s < e"):
        pair_features(hidden, [A], (3, 3))


def test_turn_spans_and_row_features_read_the_predicting_positions():
    assert turn_spans(torch.tensor([1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)) == [(0, 2), (3, 4), (6, 7)]
    assert turn_spans(torch.zeros(3, dtype=torch.bool)) == []
    # with segment ids: two turns that touch are still two, a hole inside a turn splits it only without ids
    ids = torch.tensor([0, 0, 1, 1, -1, 2, 2])
    assert turn_spans(torch.tensor([1, 1, 1, 1, 0, 1, 1], dtype=torch.bool), ids) == [(0, 2), (2, 4), (5, 7)]
    # a row with prompt P = 2, completion n = 3: tokens 0, 1 are the turn, token 2 an env hole
    T, S, P = 3, 5, 2
    hidden = torch.arange(T * 2, dtype=torch.float32).view(T, 2)  # [T,D] the state at each token
    attn = torch.zeros(T, 1, S)  # [T,heads,S]: token t's row is the query at its own position P + t
    attn[0, 0, :3] = torch.tensor([0.2, 0.2, 0.6])  # token 0 (position 2): 0.6 on its own key P + 0
    attn[1, 0, :4] = torch.tensor([0.1, 0.1, 0.4, 0.4])  # token 1 (position 3)
    attn[2, 0, :5] = 0.2  # the hole's row: not read
    spans, h, a = row_turn_features(hidden, [attn], torch.tensor([True, True, False]), P, 3)
    assert spans == [(0, 2)]
    close(h, [[2.0, 3.0]])  # the state at the turn's last token e − 1 = 1
    # keys 0..P+n−1 = 0..4; prefix keys < P + s = 2: (0.4 + 0.2)/2 = 0.3; self keys [2, 4): (0.6 + 0.8)/2 = 0.7
    close(a[0, 2:], [0.3, 0.7])
    close(a[0, 0], (0.6 + 0.4) / 2)  # mean over the two queries of the row max


def test_fit_logistic_is_the_l2_optimum():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = (X[:, 0] + 0.5 * torch.randn(40, generator=g, dtype=torch.float64) > 0).double()
    C = 0.5
    w, b = fit_logistic(X, y, C)
    p = torch.sigmoid(X @ w + b)
    # stationarity of mean logloss + ‖w‖²/(2Cn): Xᵀ(p − y)/n + w/(Cn) = 0 and Σ(p − y) = 0 (the bias is not penalised)
    close(X.T @ (p - y) / 40 + w / (C * 40), [0.0, 0.0, 0.0], tol=1e-7)
    close((p - y).mean(), 0.0, tol=1e-7)
    assert w[0] > 0.5 and abs(float(w[1])) < float(w[0])  # the informative feature carries the weight


def test_probe_two_stage_score_by_hand_and_fit_errors():
    # stage 1: z1 = 2·h → h = 0.5: s_bc = σ(1) = 0.731059; tclip → σ(1/2) = 0.622459
    # stage 2: z2 = 1·a + 2·tclip(s_bc) − 1 = 0.3 + 1.244919 − 1 = 0.544919 → σ = 0.632957
    one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    probe = PairProbe(
        params={
            "mean1": zero,
            "scale1": one,
            "w1": 2 * one,
            "b1": torch.tensor(0.0, dtype=torch.float64),
            "mean2": torch.zeros(2, dtype=torch.float64),
            "scale2": torch.ones(2, dtype=torch.float64),
            "w2": torch.tensor([1.0, 2.0], dtype=torch.float64),
            "b2": torch.tensor(-1.0, dtype=torch.float64),
        }
    )
    s_bc, s_final = probe.score(torch.tensor([[0.5]]), torch.tensor([[0.3]]))
    close(s_bc, [sig(1.0)])
    close(s_final, [sig(0.3 + 2 * sig(0.5) - 1)])
    again = PairProbe.from_state(probe.state()).score(torch.tensor([[0.5]]), torch.tensor([[0.3]]))
    close(again[1], s_final.tolist())
    with pytest.raises(ValueError, match="both labels"):
        PairProbe().fit(torch.randn(4, 2), torch.randn(4, 3), torch.ones(4))


def test_fitted_probe_separates_and_stage_two_uses_attention():
    # labels depend on an attention feature only: stage 1 (h is noise) is near chance, stage 2 recovers it
    g = torch.Generator().manual_seed(1)
    n = 200
    y = (torch.arange(n) % 2).double()
    H = torch.randn(n, 4, generator=g, dtype=torch.float64)
    A = torch.randn(n, 2, generator=g, dtype=torch.float64) * 0.3
    A[:, 0] += 2 * y - 1
    s_bc, s_final = PairProbe(C=1.0).fit(H, A, y).score(H, A)
    assert auroc(s_final, y) > 0.95 and auroc(s_bc, y) < 0.75


def test_auroc_by_hand():
    # positives {0.35, 0.8} vs negatives {0.1, 0.4}: pairs won 0.35>0.1, 0.8>0.1, 0.8>0.4 → 3/4
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5  # a tie counts half
    assert math.isnan(auroc(torch.tensor([0.5]), torch.tensor([1])))


def test_reach_turn_labels_first_wrong_move_dooms():
    env, cache = build("env", "reach"), {}
    row = format_row(0, 6)  # distance 6, 2 turns: (4, 2), (2, 4) or (3, 3) win
    assert row["turns"] == 2
    moves = ["1", "2", "3", "4"]
    assert turn_labels(env, row, ["4", "2"], moves, 0, cache) == [1, 1]
    assert turn_labels(env, row, ["3", "3"], moves, 0, cache) == [1, 1]
    assert turn_labels(env, row, ["4", "1"], moves, 0, cache) == [1, 0]  # 5 ≠ 6 after the last turn
    assert turn_labels(env, row, ["1", "4"], moves, 0, cache) == [
        0,
        0,
    ]  # after 1, 5 left in 1 turn: doomed, the later move too
    assert turn_labels(env, row, ["x", "4"], moves, 0, cache) == [0, 0]  # an invalid move spends the turn
    row9 = format_row(3, 12)  # distance 9, 3 turns
    assert turn_labels(env, row9, ["4", "4", "1"], moves, 0, cache) == [1, 1, 1]
    assert turn_labels(env, row9, ["2", "4", "3"], moves, 0, cache) == [1, 1, 1]
    assert turn_labels(env, row9, ["1", "4", "4"], moves, 0, cache) == [1, 1, 1]  # 8 left in 2 turns: 4 + 4 still wins
    assert turn_labels(env, row9, ["2", "2", "4"], moves, 0, cache) == [
        1,
        0,
        0,
    ]  # 7 in 2 (ok), then 5 in 1: doomed, later turns too
    assert turn_labels(env, row9, ["4", "3", "1"], moves, 0, cache) == [1, 1, 0]  # the last move misses (2 left)


def test_reward_and_phase_validation():
    with pytest.raises(ConfigError, match="temperature"):
        PairReward(temperature=0.0)
    with pytest.raises(ConfigError, match="attn_layers"):
        PairReward(attn_layers=[0, 1])
    with pytest.raises(ConfigError, match="C > 0"):
        PairProbePhase(C=0.0)
    reward = PairReward(hidden_layer=4, attn_layers=[1, 2])
    assert [n.name + f"({n.arg})" for n in reward.needs] == ["hidden_at(4)", "attn_at(1)", "attn_at(2)"]
    with pytest.raises(ConfigError, match="same hidden_layer"):
        reward.use_artifact("pair_probe", {"hidden_layer": 4, "attn_layers": [1, 2, 3], "probe": {}})
    with pytest.raises(ValueError, match="no probe"):
        reward.score_rollout(_turn_rollout([0.0, 0.0], None), info_for(6))


def test_eager_quantities_match_the_models_own_forward():
    from groupwise.policy.forward import completion_logprobs
    from groupwise.policy.lm import load_policy

    model, _ = load_policy("default")
    prompts = [[5, 6, 7], [8, 9]]
    actions = torch.tensor([[[10, 11, 12], [13, 0, 0]], [[14, 15, 0], [16, 17, 18]]])  # [2,2,3]
    mask = torch.tensor([[[1, 1, 1], [1, 0, 0]], [[1, 1, 0], [1, 1, 1]]], dtype=torch.bool)
    rows = torch.ones(2, 2, dtype=torch.bool)
    with torch.no_grad():
        out = completion_logprobs(
            model, prompts, actions, mask, rows, quantities=["logp", "attn_at(2)", "hidden_at(4)", "hidden(4)"]
        )
        # no attention asked
        alone = completion_logprobs(model, prompts, actions, mask, rows, quantities=["logp", "hidden_at(1)"])
        base = completion_logprobs(model, prompts, actions, mask, rows, quantities=["logp"])
        model.set_attn_implementation("eager")
        own = model(input_ids=torch.tensor([prompts[1] + [14, 15]]), output_attentions=True, output_hidden_states=True)
        model.set_attn_implementation("sdpa")
    got = out["attn_at(2)"]  # [B,G,T,heads,S] with S = longest prompt 3 + T 3 = 6
    assert got.shape == (2, 2, 3, 4, 6) and model.config._attn_implementation == "sdpa"
    # row (1, 0): prompt [8, 9], tokens 14, 15 at positions 2, 3: their own query rows of layer 2
    torch.testing.assert_close(got[1, 0, :2, :, :4], own.attentions[1][0][:, 2:4, :].transpose(0, 1), rtol=0, atol=1e-6)
    # after the final norm
    torch.testing.assert_close(out["hidden_at(4)"][1, 0, :2], own.hidden_states[4][0, 2:4], rtol=0, atol=1e-5)
    torch.testing.assert_close(alone["hidden_at(1)"][1, 0, :2], own.hidden_states[1][0, 2:4], rtol=0, atol=1e-5)
    # hidden(4) (before the norm, at the predicting position) of token 15 is
    # not hidden_at(4) of token 14: different quantities
    assert not torch.allclose(out["hidden(4)"][1, 0, 1], out["hidden_at(4)"][1, 0, 0])
    # padding: 0
    assert (got[1, 0, 2] == 0).all() and (got[0, 1, 1:] == 0).all() and (out["hidden_at(4)"][0, 1, 1:] == 0).all()
    torch.testing.assert_close(got[0, 0].sum(-1), torch.ones(3, 4), rtol=0, atol=1e-5)  # each row a distribution
    torch.testing.assert_close(out["logp"], base["logp"])  # logp unchanged by the extra pass


PAIR_RUN = [
    'data.task="reach"',
    'rollout.name="episodes"',
    "rollout.params={max_turns=16}",
    "rollout.max_new_tokens=1",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    'rewards=[{name="env_return", weight=0.0}, {name="pair", attn_layers=[1, 2, 3, 4], hidden_layer=4}]',
    'advantage.estimator="pair"',
    'phases=[{name="pair_probe", prompts=48, samples=4}]',
]


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_with_the_probe_phase(tmp_path, objective):
    rows, seen = train_recorded(tmp_path, objective, *PAIR_RUN)
    summary = __import__("json").loads((tmp_path / "summary.json").read_text())["phases"]["pair_probe"]
    assert 0.0 <= summary["val_auroc_final"] <= 1.0 and summary["turns"] > 48
    assert (tmp_path / "phases" / "pair_probe.pt").exists()
    for row, batch in zip(rows, seen):
        turns = batch.extras[TURN_REWARD]  # [B,G,S]
        own = batch.row_mask
        assert batch.extra_levels[TURN_REWARD] == "segment"
        # the row's reward is Σ_t r_t (env_return has weight 0) and the advantage is the per-turn composition
        for b, g in batch.group_valid.nonzero().tolist():
            spans = turn_spans(own[b, g], batch.segment_id[b, g])
            # an action per segment, holes between them: the same turns either way
            assert spans == turn_spans(own[b, g])
            assert [int(batch.segment_id[b, g, s]) for s, _ in spans] == list(range(len(spans)))
            r = turns[b, g, : len(spans)]  # [n]
            # r_t ∈ (0, 1) on its turns, NaN past them
            assert ((r > 0.0) & (r < 1.0)).all() and torch.isnan(turns[b, g, len(spans) :]).all()
            assert float(batch.rewards[b, g]) == pytest.approx(float(r.sum()), abs=1e-5)
        torch.testing.assert_close(batch.advantages, PairAdvantage()(batch, info_for(batch.shape[2])))
        assert (batch.advantages[~own] == 0).all()
        assert row["reward/pair"] == pytest.approx(float(batch.rewards[batch.group_valid].mean()), abs=1e-5)


def test_attention_head_off_is_stage_two_on_s_bc_alone():
    # attn_layers = (): a has no columns; stage 2 reads tclip(s_bc) only, so s_final is monotone in s_bc
    spans, h, a = row_turn_features(torch.randn(4, 3), [], torch.tensor([True, False, True, True]), 2, 4)
    assert spans == [(0, 1), (2, 4)] and a.shape == (2, 0)
    g = torch.Generator().manual_seed(2)
    H = torch.randn(60, 3, generator=g, dtype=torch.float64)
    y = (H[:, 0] > 0).double()
    s_bc, s_final = PairProbe(C=1.0).fit(H, torch.zeros(60, 0), y).score(H, torch.zeros(60, 0))
    order = s_bc.argsort()
    # stage 2's weight on s_bc is positive here
    assert float(s_final.std()) > 0.01 and (s_final[order].diff() >= -1e-12).all()
    assert auroc(s_final, y) == pytest.approx(auroc(s_bc, y), abs=1e-12)  # a monotone map keeps the ranking
    assert [n.name for n in PairReward(attn_layers=[]).needs] == ["hidden_at"]


def test_eager_providers_check_their_argument():
    from groupwise.types import Need

    attn, hidden = build("provider", "attn_at"), build("provider", "hidden_at")
    hidden.check(Need("hidden_at(0)"))  # 0 = the embeddings
    attn.check(Need("attn_at(1)"))
    for provider, bad in ((attn, "attn_at(0)"), (attn, "attn_at"), (hidden, "hidden_at(x)")):
        with pytest.raises(ConfigError, match="integer"):
            provider.check(Need(bad))
    assert not attn.grad_ok and not hidden.grad_ok  # no autograd through the eager pass
