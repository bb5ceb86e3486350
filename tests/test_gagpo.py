"""GAGPO (spec 23, ``advantages/gagpo.py``) and its mechanism M5: the spec's hand-worked group (λ = 0,
1, 0.95, both norms), the per-segment ratio of ``gspo(span="segment")`` (exp(0.2)) and its row form
unchanged, the per-turn facts of ``episodes`` (``turn_facts``), the build-time refusal without them,
the ``keydoor`` game by hand, and both recipes through the trainer."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch
from helpers import info_for, leaf
from test_grow import scripted_ctx
from test_trainer import make_trainer

from groupwise.advantages.gagpo import GAGPOAdvantage, gagpo_gae, gagpo_turn_advantages, turn_to_tokens
from groupwise.build import build as build_parts
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.losses.gspo import GSPO
from groupwise.registry import build
from groupwise.rollout.episodes import STATE_ID, STEP_REWARD
from groupwise.run import Run
from groupwise.trainer import Trainer
from groupwise.types import Rollout

keydoor = importlib.import_module("groupwise.papers.23_gagpo.keydoor")

# ---------------------------------------------------------------------------------------------- the spec's group
# One group, γ = 1, three trajectories of two turns, terminal after turn 2:
#   traj1: s0 →a→ s1 →b→ T, rewards [0, 1];  traj2: s0 →a→ s1 →c→ T, [0, 0];  traj3: s0 →d→ s2 →e→ T, [0, 0]
STATES = torch.tensor([[[0.0, 1], [0, 1], [0, 2]]])  # [1,3,2]
REWARDS = torch.tensor([[[0.0, 1], [0, 0], [0, 0]]])  # [1,3,2]
ALL = torch.ones(1, 3, 2, dtype=torch.bool)


def test_the_specs_group_by_hand():
    # returns G: [1,1], [0,0], [0,0]; V(s0) = 1/3, V(s1) = (1 + 0)/2 = 1/2, V(s2) = 0
    # λ = 0: δ = r + V(s') − V(s): traj1 [1/2 − 1/3, 1 − 1/2], traj2 [1/2 − 1/3, 0 − 1/2], traj3 [0 − 1/3, 0 − 0]
    lam0 = [[1 / 6, 0.5], [1 / 6, -0.5], [-1 / 3, 0.0]]
    # λ = 1: Â = G − V(s): [1 − 1/3, 1 − 1/2], [0 − 1/3, 0 − 1/2], [0 − 1/3, 0 − 0]
    lam1 = [[2 / 3, 0.5], [-1 / 3, -0.5], [-1 / 3, 0.0]]
    # λ = 0.95: Â_0 = δ_0 + 0.95·δ_1: 1/6 + 0.475 = 0.6417, 1/6 − 0.475 = −0.3083, −1/3 + 0 = −1/3
    lam95 = [[1 / 6 + 0.475, 0.5], [1 / 6 - 0.475, -0.5], [-1 / 3, 0.0]]
    for lam, want in ((0.0, lam0), (1.0, lam1), (0.95, lam95)):
        got = gagpo_gae(STATES, REWARDS, ALL, gamma=1.0, lam=lam)[0]
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    # λ = 0 normalised: mean 0, population std sqrt((1/36 + 1/4 + 1/36 + 1/4 + 1/9 + 0)/6) = sqrt(1/9) = 1/3
    norm0 = gagpo_turn_advantages(STATES, REWARDS, ALL, 1.0, 0.0, "center_scale", 0.0)[0]
    torch.testing.assert_close(norm0, torch.tensor([[0.5, 1.5], [0.5, -1.5], [-1.0, 0.0]], dtype=torch.float64))
    # the key difference from GRPO: action a of the FAILED traj2 gets positive credit (+0.5)
    assert norm0[1, 0] > 0
    # λ = 1 normalised: mean 0, variance (4/9 + 1/4 + 1/9 + 1/4 + 1/9 + 0)/6 = 7/36, std = sqrt(7)/6
    norm1 = gagpo_turn_advantages(STATES, REWARDS, ALL, 1.0, 1.0, "center_scale", 0.0)[0]
    torch.testing.assert_close(norm1, torch.tensor(lam1, dtype=torch.float64) / (7**0.5 / 6))


def test_scale_only_keeps_the_mean():
    # A no-op action keeps the state: traj1 s0 →(stay)→ s0 →→ T, rewards [0, 1]; traj2 s0 → T, reward [0]. γ = 1, λ = 0.
    # G: [1, 1], [0]; V(s0) = (1 + 1 + 0)/3 = 2/3. δ: traj1 [0 + 2/3 − 2/3, 1 − 2/3] = [0, 1/3]; traj2 [0 − 2/3]
    # mean −1/9; centred [1/9, 4/9, −5/9]; population variance (1 + 16 + 25)/81/3 = 14/81, std sqrt(14)/9
    states = torch.tensor([[[0.0, 0.0], [0.0, float("nan")]]])
    rewards = torch.tensor([[[0.0, 1.0], [0.0, float("nan")]]])
    valid = torch.isfinite(rewards)
    std = 14**0.5 / 9
    centre = gagpo_turn_advantages(states, rewards, valid, 1.0, 0.0, "center_scale", 0.0)[0]
    scale = gagpo_turn_advantages(states, rewards, valid, 1.0, 0.0, "scale_only", 0.0)[0]
    torch.testing.assert_close(centre, torch.tensor([[1 / 9, 4 / 9], [-5 / 9, 0]], dtype=torch.float64) / std)
    torch.testing.assert_close(scale, torch.tensor([[0.0, 1 / 3], [-2 / 3, 0]], dtype=torch.float64) / std)


def test_a_group_without_contrast_gets_zero_and_gamma_discounts():
    # every episode fails identically: all Â = 0 → exactly 0 (no division by eps)
    zero = gagpo_turn_advantages(STATES, torch.zeros(1, 3, 2), ALL, 0.95, 0.95, "scale_only", 1e-6)
    assert (zero == 0).all()
    # γ = 0.5, λ = 1 on traj1 alone (one episode: V = G): G = [0.5, 1], Â = G − V = 0
    alone = gagpo_gae(STATES[:, :1], REWARDS[:, :1], ALL[:, :1], gamma=0.5, lam=1.0)
    assert (alone == 0).all()
    # γ = 0.5, λ = 0 on the spec's group: V(s0) = (0.5 + 0 + 0)/3 = 1/6, V(s1) = 1/2;
    # traj3's first turn: δ = 0 + 0.5·V(s2) − V(s0) = −1/6
    assert gagpo_gae(STATES, REWARDS, ALL, gamma=0.5, lam=0.0)[0, 2, 0].item() == pytest.approx(-1 / 6)


def test_turn_advantages_reach_the_tokens_of_their_turn():
    turn_adv = torch.tensor([[[0.5, 1.5]]], dtype=torch.float64)  # [1,1,2]
    segment_id = torch.tensor([[[0, -1, -1, 1, 1, -1]]])  # a_0 ‖ two env tokens ‖ a_1 (two tokens) ‖ padding
    mask = torch.tensor([[[True, False, False, True, True, False]]])
    assert turn_to_tokens(turn_adv, segment_id, mask).tolist() == [[[0.5, 0, 0, 1.5, 1.5, 0]]]


# ---------------------------------------------------------------------------------------------- gspo span
def _one_row(log_ratios, segment_id):
    T = len(log_ratios)
    mb = Rollout(
        prompt_ids=[[1]],
        actions=torch.zeros(1, 1, T, dtype=torch.long),
        mask=torch.ones(1, 1, T, dtype=torch.bool),
        group_valid=torch.ones(1, 1, dtype=torch.bool),
        truncated=torch.zeros(1, 1, dtype=torch.bool),
        prompt_index=torch.tensor([0]),
        segment_id=torch.tensor([[segment_id]]),
    )
    logp = leaf(torch.full((1, 1, T), -1.0))
    mb = dataclasses.replace(mb, logp_old=logp.detach() - torch.tensor([[log_ratios]]), advantages=torch.ones(1, 1))
    return mb, {"logp": logp}


def test_segment_ratio_is_the_turns_length_normalised_ratio():
    # turn 0's tokens have log-ratios 0.1 and 0.3 → ρ = exp(0.2) = 1.2214; turn 1's one token 0.5 → exp(0.5)
    mb, out = _one_row([0.1, 0.3, 0.0, 0.5], [0, 0, -1, 1])
    ratio, adv = GSPO(eps_low=0.2, eps_high=0.2, span="segment")._ratio_adv(mb, out)
    torch.testing.assert_close(ratio[0, 0, [0, 1, 3]], torch.tensor([1.2214028, 1.2214028, 1.6487213]))
    assert adv[0, 0].tolist() == [1.0, 1.0, 0.0, 1.0]  # the token in no turn gets no loss
    loss = GSPO(eps_low=0.2, eps_high=0.2, span="segment")(mb, out, info_for(4))
    # −min(ρ·1, clip(ρ, 0.8, 1.2)·1) = −1.2 on every turn token (both ratios clip), 0 off the turns
    torch.testing.assert_close(loss[0, 0], torch.tensor([-1.2, -1.2, 0.0, -1.2]))
    # the row form over the same tokens: one ratio, exp(mean(0.1, 0.3, 0, 0.5)) = exp(0.225)
    row, _ = GSPO(span="row")._ratio_adv(mb, out)
    torch.testing.assert_close(row[0, 0], torch.full((4,), 1.2523227))


def test_segment_span_needs_segments_and_row_span_is_todays_term():
    mb, out = _one_row([0.1, 0.3], [0, 0])
    with pytest.raises(ConfigError, match="span='segment'.*segment_id.*episodes"):
        GSPO(span="segment")(dataclasses.replace(mb, segment_id=None), out, info_for(2))
    with pytest.raises(ConfigError, match="span must be"):
        GSPO(span="turn")
    # row (the default) is byte-identical to the term before the option: today's formula, written out
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    mask = torch.rand(2, 3, 5, generator=g) > 0.3
    mb = Rollout(
        prompt_ids=[[1], [2]],
        actions=torch.zeros(2, 3, 5, dtype=torch.long),
        mask=mask,
        group_valid=torch.ones(2, 3, dtype=torch.bool),
        truncated=torch.zeros(2, 3, dtype=torch.bool),
        prompt_index=torch.tensor([0, 1]),
        logp_old=old,
        advantages=torch.randn(2, 3, generator=g),
    )
    lp = torch.where(mask, logp, 0.0)
    log_s = (torch.where(mask, lp - torch.where(mask, old, 0.0), 0.0).sum(-1) / mask.sum(-1).clamp(min=1))[..., None]
    ratio = torch.exp(log_s + lp - lp)
    adv = torch.where(mask, torch.as_tensor(mb.advantages)[..., None].expand(2, 3, 5), 0.0)
    want = -torch.minimum(ratio * adv, ratio.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    got = GSPO()(mb, {"logp": logp}, info_for(5))
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- turn facts
KEYROWS = [keydoor.format_row(3, 0), keydoor.format_row(1, 1)]


def test_episodes_write_turn_rewards_and_dense_state_ids():
    # episode 0 picks the key (2) then types 3, episode 1 picks 1 (no key) then types 3: row 0 (code 3) opens once,
    # row 1 (code 1) never
    script = [["2", "3"], ["1", "3"]]
    ctx = scripted_ctx(KEYROWS, script, group_size=2)
    batch = build("rollout", "episodes", turn_facts=True)(ctx)  # the env ends each episode after 2 turns
    # states in order of first appearance: "pick 1-4=" 0, "door 3 key=" 1, "door 3=" 2, "door 1 key=" 3, "door 1=" 4
    assert batch.extras[STATE_ID].tolist() == [[[0, 1], [0, 2]], [[0, 3], [0, 4]]]
    assert batch.extras[STEP_REWARD].tolist() == [[[0, 1], [0, 0]], [[0, 0], [0, 0]]]
    assert batch.extra_levels[STATE_ID] == "segment" and batch.rewards.tolist() == [[1, 0], [0, 0]]
    plain = build("rollout", "episodes")(scripted_ctx(KEYROWS, script, group_size=2))
    assert STATE_ID not in plain.extras and STEP_REWARD not in plain.extras
    # gagpo, γ = λ = 1, group 0: G = [1, 1], [0, 0]; V(pick) = 1/2, V(door 3 key) = 1, V(door 3) = 0
    adv = GAGPOAdvantage(gamma=1.0, lam=1.0, eps=0.0)(batch, info_for(3))  # [B,G,T]
    # group 0: Â [[1/2, 0], [−1/2, 0]], mean 0, std sqrt((1/4 + 1/4)/4) = 1/(2√2): A = [[√2, 0], [−√2, 0]]
    # tokens: a_0 ‖ " door 3 key=" (12 env tokens) ‖ a_1; group 1 has no contrast: 0
    assert adv[0, 0, 0].item() == pytest.approx(2**0.5) and adv[0, 1, 0].item() == pytest.approx(-(2**0.5))
    assert (adv[0, :, 1:] == 0).all() and (adv[1] == 0).all()


def test_gagpo_fails_at_build_without_the_turn_facts(tmp_path):
    with pytest.raises(ConfigError, match="turn_facts=true"):
        make_trainer(
            tmp_path, 'data.task="keydoor"', 'rollout.name="episodes"', 'advantage.estimator="gagpo"', "eval.size=0"
        )
    with pytest.raises(ConfigError, match=r"gagpo.*'env/step_reward'.*'grow'"):
        make_trainer(tmp_path, 'data.task="keydoor"', 'rollout.name="grow"', 'advantage.estimator="gagpo"')


# ---------------------------------------------------------------------------------------------- the game
def test_keydoor_rules_by_hand():
    env = keydoor.KeyDoor()
    row = keydoor.format_row(3, 7)
    assert env.reset(row, 0) == "pick 1-4=" and row["answer"] == "2 3"
    assert env.step("2") == ("door 3 key=", 0.0, False)
    assert env.step(" 3") == ("door 3 key=", 1.0, True)
    assert env.outcome() == {"key": True, "opened": True, "turns": 2}
    env.reset(row, 0)
    assert env.step("1") == ("door 3=", 0.0, False) and env.step("3") == ("door 3=", 0.0, True)  # no key: locked
    slack = keydoor.KeyDoor(slack=1)
    slack.reset(row, 0)
    slack.step("2")
    assert slack.step("4") == ("door 3 key=", 0.0, False) and slack.step("3") == ("door 3 key=", 1.0, True)
    assert [env.action_value(row, a) for a in ("2", " 2", "1", "3", "")] == [1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="key must be one digit"):
        keydoor.KeyDoor(key=12)


def test_keydoor_splits_are_disjoint():
    test, train = keydoor._rows("test", 0), keydoor._rows("train", 0)
    assert len(test) == keydoor.TEST_SIZE and len(train) == 400 - keydoor.TEST_SIZE
    assert not {(r["code"], r["room"]) for r in test} & {(r["code"], r["room"]) for r in train}
    assert {r["code"] for r in test} == {1, 2, 3, 4}


@pytest.mark.parametrize("recipe", ["gagpo", "gagpo_grpo"])
def test_both_recipes_train_two_steps(tmp_path, recipe):
    cfg, _ = load_config(
        recipe, [f'out="{tmp_path}"', "train.steps=2", "rollout.prompts_per_step=2", "eval.size=2", "threads=1"]
    )
    trainer = Trainer(build_parts(cfg))
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [0, 1]
    assert all(0 <= r["env/key"] <= 1 and r["episodes/env_steps"] == 2 * 8 * 2 for r in rows if "loss" in r)
