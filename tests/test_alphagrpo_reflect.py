"""AlphaGRPO's reflection rollout (spec 27, "Reflection task" and FPR): the attempt it selects, the
reflection context it builds, the stage-1 reward it hands the ``alphagrpo`` advantage — by hand on
a scripted rollout context — and end to end through the trainer (contexts, the forward under them,
seeds, composition with ppo_clip and gspo)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import train_recorded
from test_trainer import make_trainer

from groupwise.advantages.alphagrpo import fpr_rewards, per_prompt_advantages
from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rewards.dvreward import DVReward
from groupwise.rollout.alphagrpo_reflect import INSTRUCTION, TEMPLATE, reflection_context, select_attempt
from groupwise.rollout.context import RolloutContext, check_strategy
from groupwise.types import Rollout, StepInfo


def _close(actual, expected, atol=1e-4):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


# ---------------------------------------------------------------------------------------------- pieces
def test_reflection_context_is_prompt_attempt_instruction():
    assert reflection_context("number even=", "37") == "number even=37\n" + INSTRUCTION
    assert reflection_context("p=", "1", "fix:", "{instruction}|{completion}|{prompt}") == "fix:|1|p="
    chat = reflection_context([{"role": "user", "content": "number even="}], "37", "fix it")
    assert chat[1:] == [{"role": "assistant", "content": "37"}, {"role": "user", "content": "fix it"}]
    assert TEMPLATE == "{prompt}{completion}\n{instruction}"


def test_select_attempt_lowest_skips_invalid_and_nan():
    t = torch.tensor
    assert select_attempt(t([0.6, 0.3, 0.9]), t([True, True, True])) == 1
    assert select_attempt(t([0.3, 0.3]), t([True, True])) == 0  # ties: the first
    # invalid and NaN rows are never picked
    assert select_attempt(t([0.6, 0.1, float("nan")]), t([True, False, True])) == 0
    assert select_attempt(t([float("nan"), 0.2]), t([True, False])) == -1


def test_select_attempt_softmax_draws_with_probability_softmax_of_one_minus_r():
    r, valid = torch.tensor([0.0, 1.0, float("nan")]), torch.tensor([True, True, True])
    gen = torch.Generator().manual_seed(0)
    picks = torch.tensor([select_attempt(r, valid, "softmax", gen) for _ in range(4000)])
    assert not bool((picks == 2).any())  # the NaN row has probability 0
    p0 = math.e / (math.e + 1.0)  # softmax(1 − [0, 1]) = [e, 1] / (e + 1) = [0.7311, 0.2689]
    assert abs(float((picks == 0).double().mean()) - p0) < 0.025  # 4000 draws: sd 0.007
    again = [select_attempt(r, valid, "softmax", torch.Generator().manual_seed(5)) for _ in range(3)]
    assert len(set(again)) == 1  # the same generator seed, the same draw


def test_config_errors_and_the_strategy_collects_the_stage1_reward():
    for bad in ({"initial": 0}, {"select": "highest"}, {"template": "{prompt}{completion}"}):
        with pytest.raises(ConfigError):
            build("rollout", "alphagrpo_reflect", **bad)
    policy = type("P", (), {"request_options": (), "modality": "text", "hooks": ()})()
    fpr = build("advantage", "alphagrpo", fpr=True)
    check_strategy(build("rollout", "alphagrpo_reflect"), policy, [fpr])
    with pytest.raises(ConfigError, match="stage1_reward"):
        check_strategy(build("rollout", "sample"), policy, [fpr])


# ---------------------------------------------------------------------------------------- by hand on a scripted context
def _rows(keys, rewards, texts, prompts):
    B, G = len(keys), len(rewards[0])
    return Rollout(
        prompt_ids=prompts,
        actions=(20 + torch.arange(G)).repeat(B, 1)[..., None],
        mask=torch.ones(B, G, 1, dtype=torch.bool),
        group_valid=torch.ones(B, G, dtype=torch.bool),
        truncated=torch.zeros(B, G, dtype=torch.bool),
        prompt_index=torch.tensor(keys),
        meta=[{"prompt": f"p{k}=", "attrs": "even"} for k in keys],
        completions=texts,
        rewards=torch.tensor(rewards),
    )


class Scripted:
    """A rollout context answering the strategy's two rounds with given rewards."""

    group_size, max_rounds = 4, 1

    def __init__(self, first, refined, keys=(5,), step=0, seed=0):
        self.first, self.refined, self.keys, self.step, self.seed = first, refined, list(keys), step, seed
        self.batch_size = len(self.keys)
        self.requests = []
        self.policy = type("P", (), {"encode": staticmethod(encode)})()

    def draw(self, n, round_=0):
        return self.keys

    def rollout(self, requests, round_=0):
        self.requests.append(requests)
        if len(self.requests) == 1:
            return _rows(
                self.keys,
                self.first,
                [[f"{k}{j}" for j in range(len(self.first[0]))] for k in self.keys],
                [encode(f"p{k}=") for k in self.keys],
            )
        return _rows(self.keys, self.refined, [["r"] * 4 for _ in self.keys], [r.prompt for r in requests])

    def keep(self, batch):
        return torch.ones(batch.shape[0], dtype=torch.bool)

    def info(self, round_=0):
        return StepInfo(step=self.step, seed=self.seed, max_new_tokens=4)


def test_strategy_output_and_fpr_advantage_by_hand():
    ctx = Scripted(first=[[0.6, 0.3]], refined=[[0.5, 0.25, 0.3, 0.7]])
    strategy = build("rollout", "alphagrpo_reflect", initial=2)
    batch = strategy(ctx)
    assert [(r.key, r.n, r.offset) for r in ctx.requests[0]] == [(5, 2, 0)]
    want = encode("p5=51\n" + INSTRUCTION)  # the lowest first attempt (row 1, reward 0.3, text "51")
    assert [(r.key, r.n, r.offset, r.prompt) for r in ctx.requests[1]] == [(5, 4, 2, want)]
    assert batch.ctx == [[want] * 4] and batch.prompt_ids == [encode("p5=")]  # trained under the reflection context
    assert batch.extra_levels["stage1_reward"] == "group" and batch.extras["stage1_reward"].tolist() == [
        pytest.approx(0.3)
    ]
    # spec 27's FPR numbers: refined [0.5, 0.25, 0.3, 0.7] vs 0.3 -> [0.5, 0.3, 0.3, 0.7] ->
    # [0.3013, −0.9040, −0.9040, 1.5066]
    info = ctx.info()
    _close(build("advantage", "alphagrpo", fpr=True)(batch, info), [[0.3013, -0.9040, -0.9040, 1.5066]])
    # without FPR: plain per-prompt normalisation of [0.5, 0.25, 0.3, 0.7]: mean 0.4375, std 0.17410
    s = math.sqrt(((0.0625**2) + 0.1875**2 + 0.1375**2 + 0.2625**2) / 4) + 1e-4
    _close(build("advantage", "alphagrpo")(batch, info), [[0.0625 / s, -0.1875 / s, -0.1375 / s, 0.2625 / s]])
    stats = strategy.step_stats()
    assert stats["reflect/improved"] == 0.5 and stats["reflect/any_improved"] == 1.0
    assert stats["reflect/stage1_reward"] == pytest.approx(0.3) and stats["reflect/refined_reward"] == pytest.approx(
        0.4375
    )


def test_train_first_adds_the_attempts_as_their_own_group():
    ctx = Scripted(first=[[0.6, 0.3]], refined=[[0.5, 0.25, 0.3, 0.7]])
    batch = build("rollout", "alphagrpo_reflect", initial=2, train_first=True)(ctx)
    assert batch.shape[:2] == (2, 4) and batch.group_valid.tolist() == [[True, True, False, False], [True] * 4]
    assert batch.ctx[0][:2] == [encode("p5=")] * 2 and batch.ctx[1] == [encode("p5=51\n" + INSTRUCTION)] * 4
    s = batch.extras["stage1_reward"]
    assert math.isnan(float(s[0])) and float(s[1]) == pytest.approx(0.3)
    adv = build("advantage", "alphagrpo", fpr=True, by="group")(batch, ctx.info())
    # the attempts' group: plain (r − mean)/(std + 1e-4) of [0.6, 0.3] (FPR leaves a NaN stage-1 group alone);
    # the refinements: spec 27's FPR numbers
    _close(adv, [[0.15 / 0.1501, -0.15 / 0.1501, 0, 0], [0.3013, -0.9040, -0.9040, 1.5066]])
    policy = type("P", (), {"request_options": (), "modality": "text", "hooks": ()})()
    strategy = build("rollout", "alphagrpo_reflect", initial=2, train_first=True)
    check_strategy(strategy, policy, [build("advantage", "alphagrpo", fpr=True, by="group")])
    for bad in ({"fpr": True}, {"by": "group", "baseline": "group_mean"}):
        with pytest.raises(ConfigError, match="train_first"):
            check_strategy(strategy, policy, [build("advantage", "alphagrpo", **bad)])
    with pytest.raises(ConfigError, match="initial >= 2"):
        build("rollout", "alphagrpo_reflect", train_first=True)


def test_no_refinement_improved_gives_a_zero_step():
    ctx = Scripted(first=[[0.3], [0.8]], refined=[[0.1, 0.3, 0.2, 0.0], [0.8, 0.5, 0.7, 0.8]], keys=(1, 2))
    strategy = build("rollout", "alphagrpo_reflect")
    batch = strategy(ctx)
    assert batch.extras["stage1_reward"].tolist() == [pytest.approx(0.3), pytest.approx(0.8)]
    assert build("advantage", "alphagrpo", fpr=True)(batch, ctx.info()).abs().sum() == 0  # the paper skips such a step
    assert strategy.step_stats()["reflect/any_improved"] == 0.0 and strategy.step_stats()["reflect/improved"] == 0.0


def test_softmax_selection_is_seeded_by_seed_step_and_prompt():
    keys = tuple(range(40))
    first, refined = [[0.0, 1.0]] * 40, [[0.5] * 4] * 40

    def picks(step, seed):
        ctx = Scripted(first, refined, keys=keys, step=step, seed=seed)
        build("rollout", "alphagrpo_reflect", initial=2, select="softmax")(ctx)
        return [r.prompt == encode(f"p{k}={k}1\n" + INSTRUCTION) for k, r in zip(keys, ctx.requests[1])]

    a = picks(0, 0)
    assert a == picks(0, 0) and 0 < sum(a) < 40  # reproducible, and both attempts get drawn
    assert a != picks(1, 0) and a != picks(0, 1)


def test_group_without_a_finite_attempt_keeps_its_refinements():
    ctx = Scripted(first=[[float("nan")]], refined=[[0.5, 0.25, 0.3, 0.7]])
    batch = build("rollout", "alphagrpo_reflect")(ctx)
    assert math.isnan(float(batch.extras["stage1_reward"][0]))
    assert ctx.requests[1][0].prompt == encode("p5=50\n" + INSTRUCTION)
    plain = per_prompt_advantages(torch.tensor([0.5, 0.25, 0.3, 0.7]), [5] * 4)
    _close(build("advantage", "alphagrpo", fpr=True)(batch, ctx.info())[0], plain.tolist(), atol=1e-6)


# ---------------------------------------------------------------------------------------------- through the trainer
REFLECT = (
    'data.task="number_attrs"',
    'rewards=[{name="dv_reward"}]',
    'rollout.name="alphagrpo_reflect"',
    "rollout.max_new_tokens=3",
)


def _record_rounds(monkeypatch):
    rounds = []
    rollout = RolloutContext.rollout
    monkeypatch.setattr(
        RolloutContext,
        "rollout",
        lambda self, requests, round_=0: rounds.append(rollout(self, requests, round_)) or rounds[-1],
    )
    return rounds


def _logprobs(model, context, actions):
    ids = torch.tensor([list(context) + actions])
    with torch.no_grad():
        logq = torch.log_softmax(model(ids).logits[0].double(), -1)  # [L,V]
    return [float(logq[len(context) - 1 + t, a]) for t, a in enumerate(actions)]


def test_contexts_are_prompt_attempt_instruction_and_the_forward_runs_under_them(tmp_path, monkeypatch):
    rounds = _record_rounds(monkeypatch)
    trainer = make_trainer(
        tmp_path,
        *REFLECT,
        'advantage.estimator={name="alphagrpo", fpr=true}',
        "rollout.params={initial=2}",
        "train.steps=1",
        "eval.size=0",
    )
    seen = {}
    prepare = trainer.prepare

    def record(batch):
        out = prepare(batch)
        b, g = 0, 0
        actions = [int(a) for a, m in zip(out.actions[b, g], out.mask[b, g]) if m]
        seen.update(
            batch=out,
            under_ctx=_logprobs(trainer.policy.module, out.ctx[b][g], actions),
            under_prompt=_logprobs(trainer.policy.module, out.prompt_ids[b], actions),
        )
        return out

    trainer.prepare = record
    row = trainer.run_step()
    batch, (first, _refined) = seen["batch"], rounds
    reward = DVReward()
    for b, meta in enumerate(batch.meta):
        texts = first.completions[b]
        j = min(range(2), key=lambda i: (float(first.rewards[b, i]), i))
        assert trainer.policy.tokenizer.decode(batch.ctx[b][0]) == meta["prompt"] + texts[j] + "\n" + INSTRUCTION
        assert all(c == batch.ctx[b][0] for c in batch.ctx[b]) and batch.prompt_ids[b] == trainer.policy.encode(
            meta["prompt"]
        )
        assert float(batch.extras["stage1_reward"][b]) == pytest.approx(
            reward([meta["prompt"]], [texts[j]], attrs=[meta["attrs"]])[0], abs=1e-6
        )
        for g, text in enumerate(batch.completions[b]):  # refinements are scored against the original row
            assert float(batch.rewards[b, g]) == pytest.approx(
                reward([meta["prompt"]], [text], attrs=[meta["attrs"]])[0], abs=1e-6
            )
    n = int(batch.mask[0, 0].sum())
    torch.testing.assert_close(
        batch.logp_old[0, 0, :n].double(), torch.tensor(seen["under_ctx"], dtype=torch.float64), atol=1e-4, rtol=0
    )
    # the context matters to the forward
    assert max(abs(a - b) for a, b in zip(seen["under_ctx"], seen["under_prompt"])) > 1e-3
    better = (batch.rewards > batch.extras["stage1_reward"][:, None]) & batch.group_valid
    assert row["reflect/improved"] == pytest.approx(float(better.sum()) / float(batch.group_valid.sum()))


def test_seeds_reproduce_the_reflection_batch(tmp_path):
    def batch(sub, seed):
        trainer = make_trainer(
            tmp_path / sub,
            *REFLECT,
            'rollout.params={initial=2, select="softmax"}',
            f"seed={seed}",
            "train.steps=1",
            "eval.size=0",
        )
        seen = {}
        prepare = trainer.prepare
        trainer.prepare = lambda b: seen.setdefault("b", prepare(b))
        trainer.run_step()
        return seen["b"]

    a, b, c = batch("a", 3), batch("b", 3), batch("c", 4)
    assert (
        torch.equal(a.actions, b.actions)
        and a.ctx == b.ctx
        and torch.equal(a.extras["stage1_reward"], b.extras["stage1_reward"])
    )
    assert a.ctx != c.ctx or not torch.equal(a.actions, c.actions)


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_with_fpr_compose(tmp_path, objective):
    rows, seen = train_recorded(
        tmp_path,
        objective,
        *REFLECT,
        'advantage.estimator={name="alphagrpo", fpr=true}',
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
    )
    for batch, row in zip(seen, rows):
        assert batch.ctx and all(c != batch.prompt_ids[b] for b, g in enumerate(batch.ctx) for c in g)
        s = batch.extras["stage1_reward"]  # [B]
        r = fpr_rewards(batch.rewards, s[:, None])  # [B,G]
        ids = [int(i) for i in batch.prompt_index for _ in range(batch.shape[1])]
        want = per_prompt_advantages(r.reshape(-1), ids, valid=batch.group_valid.reshape(-1)).reshape(batch.shape[:2])
        torch.testing.assert_close(batch.advantages, want.float())
        assert 0.0 <= row["reflect/improved"] <= 1.0 and "reflect/refined_reward" in row


@pytest.mark.slow  # a torchrun pair per case (~25 s): make test-slow / test-dist; make test stays under 10 minutes
@pytest.mark.dist
@pytest.mark.parametrize("select", ["lowest", "softmax"])
def test_reflection_step_under_two_ranks_equals_one_process(tmp_path, select):
    """The two rounds shard their requests over ranks and gather; the selection and the FPR advantage
    read the gathered batch: one step over 2 ranks (torchrun, gloo) equals one process."""
    import sys

    from test_dist_phases import SGD, _run

    args = ["alphagrpo_reflect", SGD, f'rollout.params={{initial=2, select="{select}"}}']
    one_row, one = _run([sys.executable, "-m", "groupwise"], args, tmp_path / "one")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "groupwise",
    ]
    two_row, two = _run(torchrun, args, tmp_path / "two")
    assert one_row["grad_norm"] > 0 and one_row["reflect/any_improved"] == 1.0
    for key in ("loss", "reflect/improved", "reflect/stage1_reward", "reflect/refined_reward"):
        assert abs(one_row[key] - two_row[key]) < 1e-6, (key, one_row[key], two_row[key])
    for name, weight in one.items():
        torch.testing.assert_close(two[name], weight, atol=1e-6, rtol=1e-5, msg=name)
