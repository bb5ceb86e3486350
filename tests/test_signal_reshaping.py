"""Spec 50 (signal reshaping for GRPO in agentic code repair): the layered compile/semantic reward,
the process-score token weights (step segmentation of tokens), the failure-cause-aware rollout
governance, the sandboxed ``compile_fix`` env, and the three together through the trainer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import info_for, paper_module, train_recorded
from test_grow import scripted_ctx

from groupwise.errors import ConfigError
from groupwise.registry import build, register
from groupwise.rewards.layered_code import layered_reward
from groupwise.rollout.governance import govern_group, grpo_advantage_masked
from groupwise.weights.process_score import process_token_weights

_compile_fix = paper_module("50_signal_reshaping", "compile_fix")
CompileFix, format_row, sandbox_check = _compile_fix.CompileFix, _compile_fix.format_row, _compile_fix.sandbox_check

SIGNAL = [
    'data.task="compile_fix"',
    'rollout.name="governed_episodes"',
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=3",
    "rollout.params={max_turns=2, env_params={steps=2, env_fail_prob=0.3}}",
    'rewards=[{name="env_return", weight=0.0}, {name="layered_code"}]',
    'objective.weights=["process_score"]',
    "eval.size=0",
]


# ---------------------------------------------------------------------------------------------- the spec's unit test
def test_layered_reward_and_masked_grpo_by_hand():
    compiled = torch.tensor([[True, True, False, False]])
    semantic = torch.tensor([[True, False, False, False]])
    causes = [["success", "policy_fail", "policy_fail", "env_fail"]]
    r = layered_reward(compiled, semantic, 0.5)  # [1,4]
    torch.testing.assert_close(r, torch.tensor([[1.0, 0.5, 0.0, 0.0]]))
    valid, keep = govern_group(r, causes)
    assert valid.tolist() == [[True, True, True, False]] and keep.tolist() == [True]
    torch.testing.assert_close(
        grpo_advantage_masked(r, valid), torch.tensor([[1.224745, 0.0, -1.224745, 0.0]]), atol=1e-6, rtol=0
    )
    binary = layered_reward(compiled, semantic, 0.0)  # the binary reward: no compile-only tier
    torch.testing.assert_close(
        grpo_advantage_masked(binary, valid), torch.tensor([[1.414214, -0.707107, -0.707107, 0.0]]), atol=1e-6, rtol=0
    )
    # the registered grpo estimator (population std) over the governed rows gives the same numbers
    from helpers import make_rollout

    ro = make_rollout(1, 4, 3, awkward=False)
    ro.rewards, ro.group_valid = r, valid
    adv = build("advantage", "grpo", std="population", eps=0.0)(ro, info_for(3))
    torch.testing.assert_close(adv, torch.tensor([[1.224745, 0.0, -1.224745, 0.0]]), atol=1e-6, rtol=0)
    # ungoverned: the env-failed rollout is a 0 like any failure and gets a negative advantage
    ungoverned = grpo_advantage_masked(r, torch.ones(1, 4, dtype=torch.bool))
    assert ungoverned[0, 3] < 0


def test_process_weights_by_hand():
    steps = torch.tensor([[0, 0, -1, 1], [0, 0, -1, 1]])  # [2,4]: step 0 two tokens, an env token, step 1 one token
    mask = steps >= 0
    w = process_token_weights([[1.0, 0.5], [1.0, 0.5]], steps, torch.tensor([2.0, -1.0]), True, 0.1, mask)
    torch.testing.assert_close(
        w, torch.tensor([[4 / 3, 4 / 3, 0.0, 2 / 3], [1 / 3, 1 / 3, 0.0, 5 / 3]]), atol=1e-6, rtol=0
    )
    # mean 1 over steps (not tokens): step 0 counts once although it has two tokens
    assert abs(float((w[0, 0] + w[0, 3]) / 2) - 1.0) < 1e-6
    # sign_aware=False: u = s
    off = process_token_weights([[1.0, 0.5]], steps[1:], torch.tensor([-1.0]), False, 0.1, mask[1:])
    torch.testing.assert_close(off, torch.tensor([[4 / 3, 4 / 3, 0.0, 2 / 3]]), atol=1e-6, rtol=0)
    # A = 0 reads as >= 0: u = s, floor 0.1
    zero = process_token_weights([[0.0, 1.0]], steps[:1], torch.tensor([0.0]), True, 0.1, mask[:1])
    torch.testing.assert_close(zero, torch.tensor([[0.1 / 0.55, 0.1 / 0.55, 0.0, 1 / 0.55]]), atol=1e-6, rtol=0)


def test_process_weights_edge_cases():
    steps, mask = torch.tensor([[0, 1, 2]]), torch.tensor([[True, True, False]])
    # no scores: weight 1 on loss tokens, 0 off the mask
    assert process_token_weights([[]], steps, torch.tensor([1.0]), mask=mask).tolist() == [[1.0, 1.0, 0.0]]
    # a step beyond the scores keeps 1; the masked step 2 does not enter the mean
    torch.testing.assert_close(
        process_token_weights([[1.0, 0.0, 0.0]], steps, torch.tensor([1.0]), w_min=0.1, mask=mask),
        torch.tensor([[1 / 0.55, 0.1 / 0.55, 0.0]]),
    )
    # w_min = 0 and every u = 0: the mean is 0, the row falls back to 1 (never NaN)
    assert process_token_weights([[1.0, 1.0]], steps, torch.tensor([-1.0]), w_min=0.0, mask=mask).tolist() == [
        [1.0, 1.0, 0.0]
    ]
    with pytest.raises(ValueError, match="w_min"):
        build("weight", "process_score", w_min=1.5)
    with pytest.raises(ValueError, match="r_mid"):
        build("reward", "layered_code", r_mid=-0.1)


# ---------------------------------------------------------------------------------------------- the env (sandbox)
def test_compile_fix_rules_by_hand():
    assert [sandbox_check(x) for x in ("7", " 3+4", "", "7 7", "0007", "x", "(7)")] == [
        (True, 7),
        (True, 7),
        (False, None),
        (False, None),
        (False, None),
        (False, None),
        (False, None),
    ]
    env = CompileFix(steps=3, env_fail_prob=0.0)
    assert env.reset({"a": 3, "b": 4}, seed=0) == "3+4="
    assert env.step("x") == ("3+4=", 0.0, False) and env.step("8") == ("3+4=", 0.0, False)
    assert env.step("7") == ("3+4=", 1.0, True)
    assert env.outcome() == {
        "cause": "success",
        "compiled": True,
        "semantic": True,
        "step_scores": [0.0, 0.5, 1.0],
        "steps": 3,
    }
    env.reset({"a": 3, "b": 4, "steps": 1}, seed=0)  # the row's own step budget
    assert env.step("8") == ("3+4=", 0.0, True) and env.outcome()["cause"] == "policy_fail"
    flaky = CompileFix(env_fail_prob=0.5)
    runs = []
    for seed in (1, 1, 2):
        flaky.reset({"a": 1, "b": 1}, seed)
        runs.append([flaky.step("5")[2] and flaky.outcome()["cause"] for _ in range(1)])
    assert runs[0] == runs[1]  # the injected failure is a function of the reset seed
    assert format_row(3, 4) == {"prompt": "3+4=", "answer": "7", "env": "compile_fix", "a": 3, "b": 4}
    assert (
        CompileFix().action_value({"a": 3, "b": 4}, "7") == 1.0
        and CompileFix().action_value({"a": 3, "b": 4}, "8") == 0.0
    )
    for bad in ({"steps": 0}, {"env_fail_prob": 1.0}, {"timeout_s": 0}):
        with pytest.raises(ConfigError):
            CompileFix(**bad)


@register("env", "_flaky_fix_test")
@dataclasses.dataclass
class FlakyFix(CompileFix):
    """compile_fix whose sandbox 'crashes' on the action text 'crash' (a scripted env failure)."""

    env_fail_prob: float = 0.0

    def step(self, action):
        if action.strip() == "crash":
            self.left, self.cause, self.last = self.left - 1, "env_fail", (False, False)
            return "sandbox error", 0.0, True
        return super().step(action)


ROW = {"env": "_flaky_fix_test", "a": 3, "b": 4, "prompt": "3+4=", "steps": 2}
SCRIPT = [["7"], ["8", "8"], ["x", "x"], ["crash"], ["8", "7"], ["x", "8"]]  # e = 4, 5: the replays
LAYERED = ({"name": "env_return", "weight": 0.0}, "layered_code")


def _governed(**kw):
    return build("rollout", "governed_episodes", **kw)  # max_turns = 16: the scripted policy's numbering


# ---------------------------------------------------------------------------------------------- the governance
def test_governed_episodes_drop_env_fail_and_segment_steps():
    batch = _governed()(scripted_ctx([ROW], SCRIPT, group_size=4, rewards=LAYERED))
    torch.testing.assert_close(batch.rewards, torch.tensor([[1.0, 0.5, 0.0, 0.0]]))
    assert batch.group_valid.tolist() == [[True, True, True, False]]
    assert [x["env"]["cause"] for x in batch.info[0]] == ["success", "policy_fail", "policy_fail", "env_fail"]
    # step segmentation: "8" (step 0) + " 3+4=" (env: -1) + "8" (step 1)
    assert batch.segment_id[0, 1].tolist()[:7] == [0, -1, -1, -1, -1, -1, 1]
    assert batch.segment_id[0, 0].tolist()[:1] == [0] and batch.segment_id[0, 0, 1:].eq(-1).all()
    # the per-step scores as segment values, (compiled + semantic) / 2 per step: row 0 "7" (1),
    # row 1 "8" "8" (0.5, 0.5), row 2 "x" "x" (0, 0); row 3: the crash scored nothing
    steps = batch.extras["env/step_scores"]  # [B,G,S]
    assert batch.extra_levels["env/step_scores"] == "segment" and steps.shape == (1, 4, 2)
    torch.testing.assert_close(
        steps[0, :3], torch.tensor([[1.0, float("nan")], [0.5, 0.5], [0.0, 0.0]]), equal_nan=True
    )
    assert torch.isnan(steps[0, 3]).all()
    ro = dataclasses.replace(batch)
    ro.advantages = build("advantage", "grpo", std="population", eps=0.0)(ro, info_for(7))
    torch.testing.assert_close(ro.advantages, torch.tensor([[1.224745, 0.0, -1.224745, 0.0]]), atol=1e-6, rtol=0)
    w = build("weight", "process_score")(ro, info_for(7))  # row 2: A < 0, s = [0, 0] → u = [1, 1] → w = 1
    torch.testing.assert_close(w[0, 2][ro.row_mask[0, 2]], torch.ones(2))
    assert (w[0, 3] == 0).all() and (w[~ro.row_mask] == 0).all()
    strategy = _governed()
    strategy(scripted_ctx([ROW], SCRIPT, group_size=4, rewards=LAYERED))
    stats = strategy.step_stats()
    assert (
        stats["govern/cause_env_fail"] == 0.25
        and stats["govern/dropped_rows"] == 1.0
        and stats["govern/steps_to_solve"] == 1.0
    )


def test_spurious_negative_advantages_governed_vs_not():
    for govern, expected in ((True, 0.0), (False, 0.5)):  # ungoverned: rows 2 and 3 negative, row 3 is the env failure
        strategy = _governed(govern=govern)
        batch = strategy(scripted_ctx([ROW], SCRIPT, group_size=4, rewards=LAYERED))
        batch.advantages = build("advantage", "grpo", std="population", eps=0.0)(batch, info_for(7))
        strategy.prepare(batch, info_for(7))
        stats = strategy.step_stats()
        assert stats["govern/spurious_neg_frac"] == expected, govern
        assert int(batch.group_valid.sum()) == (3 if govern else 4)


def test_layered_reward_gives_signal_where_binary_gives_none():
    script = [["8"], ["x"], ["9"], ["x"]]  # nothing passes, two compile
    for rewards, signal in (
        (LAYERED, 1.0),
        (({"name": "env_return", "weight": 0.0}, {"name": "layered_code", "r_mid": 0.0}), 0.0),
    ):
        strategy = build("rollout", "governed_episodes")
        batch = strategy(scripted_ctx([{**ROW, "steps": 1}], script, group_size=4, rewards=rewards))
        batch.advantages = build("advantage", "grpo")(batch, info_for(3))
        strategy.prepare(batch, info_for(3))
        assert (
            strategy.step_stats()["govern/mid_groups"] == 1.0
            and strategy.step_stats()["govern/mid_signal_frac"] == signal
        )


def test_resample_replaces_env_failed_episodes_and_min_valid_drops_groups():
    strategy = _governed(max_resample=1)
    batch = strategy(scripted_ctx([ROW], SCRIPT, group_size=4, rewards=LAYERED))
    # the env-failed slot 3 is replayed as episode 4 ("8" then "7": success in 2 steps)
    assert batch.info[0][3]["actions"] == ["8", "7"] and batch.group_valid.all()
    torch.testing.assert_close(batch.rewards, torch.tensor([[1.0, 0.5, 0.0, 1.0]]))
    assert strategy.step_stats()["govern/resampled"] == 1.0
    two = [["7"], ["crash"]]
    # one valid row left: the group leaves
    assert _governed()(scripted_ctx([ROW], two, group_size=2, rewards=LAYERED)).shape[0] == 0
    assert _governed(min_valid=1)(scripted_ctx([ROW], two, group_size=2, rewards=LAYERED)).shape[0] == 1
    for bad in ({"max_resample": -1}, {"min_valid": 0}):
        with pytest.raises(ConfigError):
            _governed(**bad)


def test_layered_code_without_facts_is_no_verdict():
    from helpers import make_rollout

    ro = make_rollout(2, 3, 4, awkward=False)
    ro.info = [
        [{"env": {"compiled": True, "semantic": False}}, {}, {"env": {"compiled": True, "semantic": True}}],
        [{}, {}, {}],
    ]
    r = build("reward", "layered_code").score_rollout(ro, info_for(4))
    assert r[0, 0] == 0.5 and r[0, 2] == 1.0 and torch.isnan(r[0, 1]) and torch.isnan(r[1]).all()


# ---------------------------------------------------------------------------------------------- through the trainer
@pytest.mark.parametrize("objective,estimator", [("ppo_clip", "grpo"), ("gspo", "grpo"), ("ppo_clip", "sign")])
def test_trains_with_objectives_and_estimators(tmp_path, objective, estimator):
    rows, seen = train_recorded(tmp_path, objective, *SIGNAL, f'advantage.estimator="{estimator}"')
    for row, batch in zip(rows, seen):
        fail = torch.tensor([[x["env"]["cause"] == "env_fail" for x in g] for g in batch.info])  # [B,G]
        assert not (batch.group_valid & fail).any()  # governed: no env-failed row is trained
        assert (batch.advantages[fail] == 0).all()
        assert row["govern/spurious_neg_frac"] == 0.0
        assert batch.weight is not None and (batch.weight[~batch.row_mask] == 0).all()
        if estimator == "sign":  # sign's A = 2r − 1 for the layered tiers
            r = batch.rewards[batch.group_valid]
            torch.testing.assert_close(batch.advantages[batch.group_valid], 2 * r - 1)
    weights = torch.cat([b.weight[b.row_mask] for b in seen])
    assert (weights != 1).any()  # the process scores reshaped some tokens
