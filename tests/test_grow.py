"""GROW (spec 04): the Env runner, the reach game, the state-action decomposition and its group
advantage, the trajectory-level ``episodes`` strategy (loss-mask holes at environment tokens), and
both strategies through the trainer on the embedded model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import info_for, leaf, objective_for
from test_trainer import make_trainer

from groupwise.config import RewardCfg
from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rewards.stage import RewardStage
from groupwise.rollout.context import RolloutContext
from groupwise.rollout.env import greedy_success, play
from groupwise.rollout.grow import step_returns
from groupwise.run import Run
from groupwise.tasks.reach import Reach, format_row, parse_move
from groupwise.types import Rollout, StepInfo


# ---------------------------------------------------------------------------------------------- a scripted policy
class Scripted:
    """Characters as tokens (``encode("left 7=")`` = the 7 code points); the action of episode e,
    turn t is ``script[e][t]`` (the request offset is e·max_turns + t)."""

    modality, request_options, context = "text", frozenset({"greedy"}), 128

    def __init__(self, script, max_turns=16):
        self.script, self.max_turns = script, max_turns

    def encode(self, text):
        return [ord(c) for c in text]

    def check_fits(self, ids, max_new_tokens, where):
        if len(ids) + max_new_tokens > self.context:
            raise ConfigError(f"{where}: too long")

    def decode(self, rollout):
        B, G, _ = rollout.shape
        return [
            ["".join(chr(t) for t in rollout.actions[b, g][rollout.mask[b, g]].tolist()) for g in range(G)]
            for b in range(B)
        ]

    def generate(self, requests, sampling, info):
        texts = [self.script[r.offset // self.max_turns][r.offset % self.max_turns] for r in requests]
        T = max(1, max(len(t) for t in texts))
        actions = torch.zeros(len(requests), 1, T, dtype=torch.long)  # [R,1,T]
        for i, text in enumerate(texts):
            actions[i, 0, : len(text)] = torch.tensor([ord(c) for c in text], dtype=torch.long)
        lengths = torch.tensor([[len(t)] for t in texts])  # [R,1]
        return Rollout(
            prompt_ids=[r.prompt for r in requests],
            actions=actions,
            mask=torch.arange(T) < lengths[..., None],
            group_valid=torch.ones(len(requests), 1, dtype=torch.bool),
            truncated=torch.zeros(len(requests), 1, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests]),
            logp_sampler=torch.full((len(requests), 1, T), -0.5),
        )


class AllRows:
    max_rounds = 1

    def draw(self, n, info):
        return list(range(n))

    def keep(self, batch):
        return torch.ones(batch.shape[0], dtype=torch.bool)


def scripted_ctx(rows, script, group_size, rewards=("env_return",)):
    policy = Scripted(script)
    stage = RewardStage(list(rewards), RewardCfg(), policy.decode, 1)
    return RolloutContext(
        policy,
        AllRows(),
        stage,
        lambda r: None,
        lambda i: policy.encode(rows[i]["prompt"]),
        lambda i: rows[i],
        lambda round_=0: StepInfo(step=0, seed=0, max_new_tokens=1),
        {"max_new_tokens": 1},
        len(rows),
        group_size,
    )


ROW = {"env": "reach", "start": 0, "goal": 7, "turns": 3, "prompt": "left 7="}
SPEC = [["3", "3", "1"], ["4", "4"]]  # ξ_1: 3, 6, 7 — won in 3 steps; ξ_2: 4, 8 — overshot in 2 steps
enc = Scripted(None).encode


# ---------------------------------------------------------------------------------------------- the game
def test_reach_rules_by_hand():
    env = Reach()
    assert env.reset({"start": 5, "goal": 11, "turns": 3}, seed=0) == "left 6="
    assert env.step("4") == ("left 2=", 0.0, False)
    assert env.step("9") == ("left 2=", 0.0, False)  # invalid: no move, the turn is spent
    assert env.step(" 2") == ("left 0=", 1.0, True)  # landed exactly: won
    env.reset({"start": 0, "goal": 3, "turns": 2}, seed=0)
    assert env.step("4") == ("left -1=", 0.0, True)  # overshoot: lost at once
    env.reset({"start": 0, "goal": 8, "turns": 2}, seed=0)
    assert env.step("1")[2] is False and env.step("1") == ("left 6=", 0.0, True)  # out of turns
    assert [parse_move(a) for a in ("1", "4", "0", "5", "12", "", "x", " 3\n")] == [
        1,
        4,
        None,
        None,
        None,
        None,
        None,
        3,
    ]
    # Q*(start, a): distance 6 in 2 turns needs a >= 2 (6 − a <= 4); distance 3 in 1 turn needs exactly 3
    six, three = {"start": 0, "goal": 6, "turns": 2}, {"start": 4, "goal": 7, "turns": 1}
    assert [env.action_value(six, a) for a in ("4", "2", "1", "5")] == [1.0, 1.0, 0.0, 0.0]
    assert [env.action_value(three, a) for a in ("3", "2", "4")] == [1.0, 0.0, 0.0]
    assert format_row(7, 18) == {
        "prompt": "left 11=",
        "answer": "4 4 3",
        "env": "reach",
        "start": 7,
        "goal": 18,
        "turns": 3,
    }


def test_reach_tasks_have_disjoint_splits_and_the_promised_horizons():
    from groupwise.tasks import get_task

    for name, moves in (("reach", range(1, 5)), ("reach_long", range(8, 11))):
        train, test = get_task(name).rows("train", 0, 0), get_task(name).rows("test", 0, 0)
        assert len(test) == 200 and not {(r["start"], r["goal"]) for r in train} & {
            (r["start"], r["goal"]) for r in test
        }
        assert {r["turns"] for r in train + test} == set(moves)
        assert all(Reach().reset(r, 0) == r["prompt"] for r in test)  # the prompt is the first observation
    # the text reward scores a lone action by Q*: held-out evaluation
    assert build("reward", "env_return")(
        ["left 6="] * 3, ["4", "1", "x"], env=["reach"] * 3, start=[0] * 3, goal=[6] * 3, turns=[2] * 3
    ) == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------- GROW
def test_spec_unit_test_through_the_decomposition_and_grpo():
    ctx = scripted_ctx([ROW], SPEC, group_size=2)
    batch = build("rollout", "grow")(ctx)
    assert batch.shape == (1, 5, 1) and batch.rewards.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]
    assert [i["episode"] for i in batch.info[0]] == [0, 0, 0, 1, 1] and [i["turn"] for i in batch.info[0]] == [
        0,
        1,
        2,
        0,
        1,
    ]
    # every context is the local state alone: no earlier turn in it
    assert batch.ctx[0] == [enc("left 7="), enc("left 4="), enc("left 1="), enc("left 7="), enc("left 3=")]
    assert batch.prompt_ids == [enc("left 7=")] and batch.completions[0] == ["3", "3", "1", "4", "4"]
    # mean 0.6; population std sqrt((3·0.16 + 2·0.36)/5) = 0.48990: 0.4/0.4899 = 0.8165, −0.6/0.4899 = −1.2247
    adv = build("advantage", "grpo", std="population", eps=1e-6)(batch, info_for(1))
    torch.testing.assert_close(adv, torch.tensor([[0.8165, 0.8165, 0.8165, -1.2247, -1.2247]]), atol=1e-4, rtol=0)
    # the library default (unbiased std sqrt(1.2/4) = 0.54772, eps 1e-4): 0.4/0.54782 = 0.7302, −0.6/0.54782 = −1.0953
    torch.testing.assert_close(
        build("advantage", "grpo")(batch, info_for(1)),
        torch.tensor([[0.7302, 0.7302, 0.7302, -1.0953, -1.0953]]),
        atol=1e-4,
        rtol=0,
    )


def test_return_to_go_and_the_sample_cut():
    assert step_returns([0.0, 0.0, 1.0], "rtg", 0.5) == [0.25, 0.5, 1.0]  # Σ γ^(t'−t) r_t'
    assert step_returns([0.0, 0.0, 1.0]) == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="step_return must be"):
        build("rollout", "grow", step_return="td")
    ctx = scripted_ctx([ROW], SPEC, group_size=2)
    cut = build("rollout", "grow", max_samples=3)(ctx)
    again = build("rollout", "grow", max_samples=3)(scripted_ctx([ROW], SPEC, group_size=2))
    assert cut.shape[1] == 3 and cut.info == again.info  # a seeded subset, the same on every call
    turns = [(i["episode"], i["turn"]) for i in cut.info[0]]
    assert turns == sorted(turns) and set(turns) < {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)}


def test_an_env_run_rejects_other_text_rewards(tmp_path):
    with pytest.raises(ConfigError, match=r"plays an environment.*\['exact'\]"):  # at the first call
        build("rollout", "grow")(scripted_ctx([ROW], SPEC, 2, rewards=("env_return", "exact")))
    # at build, through the trainer
    with pytest.raises(ConfigError, match=r"'episodes' plays an environment.*\['exact'\]"):
        make_trainer(tmp_path, *REACH, 'rollout.name="episodes"', 'rewards=["exact"]')


def test_greedy_closed_loop_success():
    rows = [
        ROW,
        {**ROW, "goal": 5},
    ]  # one greedy episode each: 3+3+1 = 7 wins the first, 3+3 = 6 > 5 overshoots the second
    assert greedy_success(Scripted(SPEC), rows, {"max_new_tokens": 1}, StepInfo(0, 0, 1)) == 0.5


# ---------------------------------------------------------------------------------------- the trajectory-level baseline
def test_episodes_holes_are_the_env_tokens_and_get_no_gradient():
    ctx = scripted_ctx([ROW], SPEC[:1], group_size=1)
    batch = build("rollout", "episodes")(ctx)
    want = enc("3") + enc(" left 4=") + enc("3") + enc(" left 1=") + enc("1")  # a_0 ‖ o_1 ‖ a_1 ‖ o_2 ‖ a_2
    assert batch.actions[0, 0].tolist() == want and batch.mask.all() and batch.rewards.tolist() == [[1.0]]
    holes = [i for i, own in enumerate(batch.loss_mask[0, 0].tolist()) if not own]
    assert holes == list(range(1, 9)) + list(range(10, 18))  # the 8 tokens of each " left k="
    assert batch.prompt_ids == [enc("left 7=")] and batch.info[0][0]["actions"] == ["3", "3", "1"]
    # PPO at ratio 1, advantage 1, token_mean over the 3 action tokens: loss −1, gradient −1/3 at actions, 0 at holes
    mb = dataclasses.replace(batch, logp_old=torch.zeros(1, 1, 19), advantages=torch.ones(1, 1))
    logp = leaf(torch.zeros(1, 1, 19))
    obj = objective_for([build("objective", "ppo_clip")], "token_mean")
    loss = obj.loss(mb, {"logp": logp}, obj.normalizers(mb, info_for(19)), info_for(19))
    (grad,) = torch.autograd.grad(loss, logp)
    expect = torch.zeros(19)
    expect[[0, 9, 18]] = -1 / 3
    assert loss.item() == pytest.approx(-1.0)
    torch.testing.assert_close(grad.flatten(), expect)


def test_episodes_truncate_at_the_context_limit():
    # prompt 7 tokens; each later turn adds 1 action + 8 env tokens. Limit 17:
    # turn 1 sees 16 (+1 fits), turn 2 would see 25: cut
    batch = build("rollout", "episodes", max_context=17)(scripted_ctx([ROW], SPEC[:1], group_size=1))
    assert (
        batch.info[0][0]["cut"] == "context"
        and batch.truncated.tolist() == [[True]]
        and batch.rewards.tolist() == [[0.0]]
    )
    assert int(batch.mask.sum()) == 10 and len(batch.prompt_ids[0]) + 10 <= 17  # the row fits the limit


# ---------------------------------------------------------------------------------------------- the embedded model
def _context(trainer):
    ro = trainer.cfg.rollout
    return RolloutContext(
        trainer.policy,
        trainer.sampler,
        trainer.reward_stage,
        lambda r: None,
        lambda i: trainer.prompts("train", trainer.train_rows, i),
        lambda i: trainer.train_rows[i],
        trainer.info,
        trainer.sampling_params,
        ro.prompts_per_step,
        ro.group_size,
    )


def _replay(row, actions):
    env = Reach()
    obs, ret = [env.reset(row, 0)], 0.0
    for a in actions:
        o, r, done = env.step(a)
        obs.append(o)
        ret += r
    return obs, ret, done


REACH = [
    'data.task="reach"',
    "rollout.max_new_tokens=1",
    "train.steps=2",
    "eval.size=8",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
]


def test_episodes_depend_only_on_seed_step_row_and_index(tmp_path):
    ctx = _context(make_trainer(tmp_path, *REACH, 'rollout.name="grow"'))
    alone, mixed = play(ctx, [3, 5], 2, 16), play(ctx, [5, 9, 3], 2, 16)
    for a, b in ((alone.episodes[0], mixed.episodes[2]), (alone.episodes[1], mixed.episodes[0])):
        assert [(e.texts, e.actions, e.contexts, e.rewards) for e in a] == [
            (e.texts, e.actions, e.contexts, e.rewards) for e in b
        ]


@pytest.mark.parametrize("strategy", ["grow", "episodes"])
def test_two_trainer_steps_reward_every_row_with_its_episodes_return(tmp_path, strategy):
    trainer = make_trainer(
        tmp_path, *REACH, f'rollout.name="{strategy}"', 'advantage.estimator={name="grpo", std="population", eps=1e-6}'
    )
    seen, prepare = [], trainer.prepare
    trainer.prepare = lambda batch: seen.append(prepare(batch)) or seen[-1]
    Run(trainer).train()
    assert len(seen) == 2
    encode = trainer.policy.encode
    for batch in seen:
        for b in range(batch.shape[0]):
            row = batch.meta[b]
            if strategy == "grow":  # rows grouped per episode, in turn order: replay each episode
                for e in {i["episode"] for i in batch.info[b] if i}:
                    g = [k for k, i in enumerate(batch.info[b]) if i and i["episode"] == e]
                    obs, ret, done = _replay(row, [batch.completions[b][k] for k in g])
                    assert done and [batch.info[b][k]["turn"] for k in g] == list(range(len(g)))
                    assert batch.rewards[b, g].tolist() == [ret] * len(g)
                    assert [batch.ctx[b][k] for k in g] == [encode(o) for o in obs[:-1]]  # local states only
            else:
                for e, i in enumerate(batch.info[b]):
                    obs, ret, done = _replay(row, i["actions"])
                    assert done and batch.rewards[b, e].item() == ret
                    own = batch.loss_mask[b, e][batch.mask[b, e]]
                    env_tokens = batch.actions[b, e][batch.mask[b, e]][~own].tolist()
                    # the holes are exactly the observations
                    assert env_tokens == [t for o in obs[1:-1] for t in encode(" " + o)]
