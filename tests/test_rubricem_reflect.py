"""RubricEM's reflection meta-policy (spec 39, rollout ``rubricem_reflect``): r_meta by hand on a
scripted rollout context, the reflection rows' prompts and rewards, bank retrieval into the next
step's context token for token, then through the trainer: two steps with ppo_clip and gspo, resume
equality of the bank and the weights, and one process against two ranks.

Hand numbers (one prompt "7+8=", key "add", G = 3, one reward "exact"): task scores s = [0, 1, 0.5];
reflections ["carry the one", "", "check units"]; re-attempt scores [1, 1, 0.25].
approve = nonempty: [yes, no (empty), yes].
baseline "attempt": r_meta = [1·(1 − 0), 0, 1·(0.25 − 0.5)] = [1, 0, −0.25];
baseline "group" (mean 0.5): r_meta = [0.5, 0, −0.25]. Accepted (approved and r_meta > 0): row 0 only.
GRPO (population std) on [1, 0, −0.25]: mean 0.25, std sqrt(0.875 / 3) → [1.38873, −0.46291, −0.92582].
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rollout.rubricem_reflect import REFLECT_TEMPLATE, feedback_text, with_hint
from groupwise.run import Run
from groupwise.types import Rollout, StepInfo

PROMPT, KEY = "7+8=", 5
TASK_S = [0.0, 1.0, 0.5]
REFLECTIONS = ["carry the one", "", "check units"]
AGAIN_S = [1.0, 1.0, 0.25]


def enc(text):
    return [ord(c) for c in text]


def _rows(prompts, rewards, texts, truncated=None):
    """A batch of len(prompts) groups, row g of group b: one token, reward rewards[b][g]
    (also its one reward column)."""
    B, G = len(rewards), len(rewards[0])
    r = torch.tensor(rewards, dtype=torch.float32)
    return Rollout(
        prompt_ids=prompts,
        actions=torch.full((B, G, 1), 7),
        mask=torch.ones(B, G, 1, dtype=torch.bool),
        group_valid=torch.ones(B, G, dtype=torch.bool),
        truncated=torch.tensor(truncated if truncated is not None else [[False] * G] * B),
        prompt_index=torch.full((B,), KEY),
        meta=[{"prompt": PROMPT, "question": "add", "answer": "15"}] * B,
        completions=texts,
        rewards=r,
        reward_parts=r[..., None].clone(),
        info=[[{} for _ in range(G)] for _ in range(B)],
    )


class Scripted:
    """A rollout context answering the strategy's calls: the task group, the reflections, the re-attempts."""

    batch_size, group_size, max_rounds = 1, 3, 1
    sampling = {"max_new_tokens": 4}

    def __init__(self, step=0):
        self.step, self.calls = step, []
        self.policy = SimpleNamespace(encode=enc, context=None)
        self.reward_stage = SimpleNamespace(labels=["exact"], text=[object()])

    def draw(self, n, round_=0):
        return [KEY]

    def meta(self, key):
        return {"prompt": PROMPT, "question": "add", "answer": "15"}

    def prompt(self, key):
        return enc(PROMPT)

    def info(self, round_=0):
        return StepInfo(step=self.step, seed=0, max_new_tokens=4)

    def keep(self, batch):
        return torch.ones(batch.shape[0], dtype=torch.bool)

    def rollout(self, requests, round_=0):
        self.calls.append(("rollout", requests))
        if len(self.calls) == 1:  # the task group
            r = requests[0]
            return _rows([r.prompt or enc(PROMPT)], [TASK_S], [["14", "15", "16"]])
        return _rows([r.prompt for r in requests], [[s] for s in AGAIN_S], [["15"]] * len(requests))

    def generate(self, requests, round_=0):
        self.calls.append(("generate", requests))
        out = _rows([r.prompt for r in requests], [[0.0]] * len(requests), [[t] for t in REFLECTIONS])
        out.rewards = out.reward_parts = None
        out.info = []
        return out

    def finish(self, batch, round_=0):
        batch.extras.pop("reward_failed")
        batch.extra_levels.pop("reward_failed")
        batch.rewards = batch.reward_parts[..., 0].float()  # one reward of weight 1
        batch.reward_parts = batch.reward_parts.float()
        batch.group_valid = batch.group_valid & torch.isfinite(batch.rewards)
        return batch


def close(got, want, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64), atol=atol, rtol=0.0
    )


def test_pieces_feedback_hint_and_chat_hint():
    assert feedback_text(["plan", "compute", "answer"], [0.5, 0.0, 1.0]) == "plan=0.5 compute=0 answer=1"
    assert feedback_text(["plan"], [float("nan")]) == "plan=none"
    assert with_hint("7+8=", "carry") == "hint:carry\n7+8="
    chat = with_hint([{"role": "system", "content": "s"}, {"role": "user", "content": "7+8="}], "carry")
    assert chat == [{"role": "system", "content": "s"}, {"role": "user", "content": "hint:carry\n7+8="}]


@pytest.mark.parametrize("baseline, want", [("attempt", [1.0, 0.0, -0.25]), ("group", [0.5, 0.0, -0.25])])
def test_r_meta_by_hand_and_the_reflection_rows(baseline, want):
    ctx = Scripted()
    strategy = build("rollout", "rubricem_reflect", baseline=baseline)
    batch = strategy(ctx)
    close(strategy.last["r_meta"], want)
    assert strategy.last["approved"] == [True, False, True] and strategy.last["accepted"] == [True, False, False]
    # the reflection prompts: the task, the judged attempt and its per-stage feedback, token for token
    kind, requests = ctx.calls[1]
    assert kind == "generate" and [r.sampling for r in requests] == [{"max_new_tokens": 16}] * 3
    assert [r.prompt for r in requests] == [
        enc(REFLECT_TEMPLATE.format(prompt=PROMPT, attempt=a, feedback=f"exact={s:.2g}"))
        for a, s in zip(["14", "15", "16"], TASK_S)
    ]
    assert [r.offset for r in requests] == [3, 4, 5] and [r.offset for r in ctx.calls[2][1]] == [6, 7, 8]
    # the re-attempts: each reflection in front of the task
    assert [r.prompt for r in ctx.calls[2][1]] == [enc(f"hint:{t}\n{PROMPT}") for t in REFLECTIONS]
    # the batch: the task group, then the reflection group (row j under its own prompt, every reward column r_meta)
    assert batch.shape[:2] == (2, 3)
    close(batch.rewards[0], TASK_S)
    close(batch.rewards[1], want)
    close(batch.reward_parts[1, :, 0], want)
    assert batch.ctx[1] == [r.prompt for r in requests] and batch.ctx[0] == [enc(PROMPT)] * 3
    assert strategy.bank.retrieve("add", 5) == ["carry the one"]
    if baseline == "attempt":  # the reflection group's advantage: population-std GRPO on r_meta
        adv = build("advantage", "grpo", std="population", eps=0.0)(batch, ctx.info())
        close(adv[1], [0.75 / math.sqrt(0.875 / 3), -0.25 / math.sqrt(0.875 / 3), -0.5 / math.sqrt(0.875 / 3)])
        close(adv[1], [1.38873, -0.46291, -0.92582])
    stats = strategy.step_stats()
    assert stats["rubricem_reflect/approved"] == pytest.approx(2 / 3) and stats[
        "rubricem_reflect/accepted"
    ] == pytest.approx(1 / 3)
    assert (
        stats["rubricem_reflect/reattempt_reward"] == pytest.approx(0.75) and stats["rubricem_reflect/bank_size"] == 1.0
    )


def test_bank_reflection_is_retrieved_into_the_next_context_exactly():
    strategy = build("rollout", "rubricem_reflect")
    strategy(Scripted(step=0))
    nxt = Scripted(step=1)
    strategy(nxt)
    task_request = nxt.calls[0][1][0]
    assert task_request.prompt == enc("hint:carry the one\n" + PROMPT)
    stats = strategy.step_stats()  # the group had a reflection of its type: a second attempt
    assert stats["rubricem_reflect/hinted_groups"] == 1.0 and stats["rubricem_reflect/second_attempt"] == pytest.approx(
        0.5
    )
    assert math.isnan(stats["rubricem_reflect/first_attempt"])
    # over the run: step 0's three rows were first attempts (mean 0.5), step 1's three second attempts (mean 0.5)
    assert strategy.state_dict()["run"] == [1.5, 3, 1.5, 3] and stats["rubricem_reflect/gap_run"] == 0.0
    # retrieve = 0: the bank is filled but stays out of the prompt;
    # the group still counts as a second attempt (placebo arm)
    off = build("rollout", "rubricem_reflect", retrieve=0)
    off.load_state_dict(strategy.state_dict())
    again = Scripted(step=1)
    off(again)
    assert again.calls[0][1][0].prompt is None and off.step_stats()["rubricem_reflect/second_attempt"] == pytest.approx(
        0.5
    )
    # retrieve_share = 0: no group is in the retrieval arm, every group is a first attempt
    none = build("rollout", "rubricem_reflect", retrieve_share=0.0)
    none.load_state_dict(strategy.state_dict())
    third = Scripted(step=1)
    none(third)
    assert third.calls[0][1][0].prompt is None and none.step_stats()["rubricem_reflect/first_attempt"] == pytest.approx(
        0.5
    )
    # two retrieved reflections are joined newest first
    two = build("rollout", "rubricem_reflect", retrieve=2)
    two.bank.add("add", "older")
    two.bank.add("add", "newer")
    fourth = Scripted(step=2)
    two(fourth)
    assert fourth.calls[0][1][0].prompt == enc("hint:newer; older\n" + PROMPT)


def test_untrained_reflections_and_config_errors():
    batch = build("rollout", "rubricem_reflect", train_reflections=False)(Scripted())
    assert batch.shape[:2] == (1, 3)
    for bad, match in [
        ({"baseline": "x"}, "baseline"),
        ({"approve": "x"}, "approve"),
        ({"retrieve": -1}, "retrieve"),
        ({"retrieve_share": 2.0}, "retrieve_share"),
        ({"reflect_template": "{prompt}"}, "attempt"),
        ({"context_template": "{prompt}"}, "hint"),
        ({"reflection_tokens": 0}, "reflection_tokens"),
        ({"capacity": 0}, "capacity"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build("rollout", "rubricem_reflect", **bad)
    with pytest.raises(ConfigError, match="key_column"):
        build("rollout", "rubricem_reflect", key_column="kind")._task_key({"prompt": "x"})
    assert build("rollout", "rubricem_reflect", key_column="")._task_key({"prompt": "7+8="}) == "7+8="


# ---------------------------------------------------------------------------------------------- through the trainer
REWARDS = (
    'rewards=[{name="stage_rubric", tags=["<p>", "</p>"], label="plan"}, {name="stage_rubric", '
    'tags=["<r>", "</r>"], label="compute"}, {name="stage_rubric", tags=["<a>", "</a>"], label="answer"}]'
)
RUN = [
    'data.task="evidence"',
    REWARDS,
    'advantage.estimator="rubricem"',
    "rollout.max_new_tokens=12",
    'rollout.name="rubricem_reflect"',
    "rollout.params={accept_above=-1.0, reflection_tokens=6}",
]


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_trains_two_steps_with(tmp_path, objective):
    from helpers import train_recorded

    from groupwise.masked import group_normalize

    rows, seen = train_recorded(tmp_path, objective, *RUN)
    for row, batch in zip(rows, seen):
        B = batch.shape[0] // 2  # task groups, then as many reflection groups (every task group kept)
        assert (
            B == 4 and batch.reward_parts.shape[-1] == 3 and batch.ctx and batch.advantages.shape == batch.actions.shape
        )
        refl = batch.select(list(range(B, 2 * B)))
        # every reward column of a reflection row is its r_meta,
        # and its tokens carry the population GRPO z-score of r_meta
        assert torch.equal(refl.reward_parts[..., 0], refl.reward_parts[..., 2])
        valid = refl.group_valid & torch.isfinite(refl.rewards)
        z = group_normalize(torch.nan_to_num(refl.reward_parts[..., 0].double()), valid, "group", 0, 1e-6)  # [B,G]
        torch.testing.assert_close(refl.advantages.double(), z[..., None] * refl.row_mask, atol=1e-6, rtol=0)
        assert (batch.advantages[~batch.row_mask] == 0).all()
        # accept_above = -1: every approved one
        assert row["rubricem_reflect/accepted"] == row["rubricem_reflect/approved"]
    assert rows[1]["rubricem_reflect/bank_size"] > 0 and rows[1]["rubricem_reflect/hinted_groups"] > 0


def _bank_and_weights(trainer):
    return trainer.strategy.state_dict(), {n: p.detach().clone() for n, p in trainer.policy.module.named_parameters()}


def test_bank_and_weights_resume_exactly(tmp_path):
    from test_trainer import make_trainer

    straight = make_trainer(tmp_path / "straight", *RUN, "train.steps=3", "eval.size=0")
    Run(straight).train()
    first = make_trainer(tmp_path / "resumed", *RUN, "train.steps=2", "checkpoint.every=1", "eval.size=0")
    Run(first).train()
    again = make_trainer(tmp_path / "resumed", *RUN, "train.steps=3", "checkpoint.every=1", "eval.size=0")
    Run(again).train(resume_allow=["train.steps"])
    bank, weights = _bank_and_weights(straight)
    bank2, weights2 = _bank_and_weights(again)
    assert len(straight.strategy.bank) > 0 and bank == bank2  # the bank and the run's attempt sums
    for name, w in weights.items():
        assert torch.equal(w, weights2[name]), name
    rows = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rubricem_reflect/hinted_groups"] for r in resumed] == [r["rubricem_reflect/hinted_groups"] for r in rows]
    assert rows[2]["rubricem_reflect/hinted_groups"] > 0  # the resumed step retrieved from the restored bank


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_hold_the_same_bank_and_train_the_same(tmp_path):
    """torchrun (gloo) over 2 ranks against one process, 2 steps:
    the same bank in the last checkpoint, the same weights."""
    from safetensors.torch import load_file

    args = [
        "train",
        "rubricem",
        "phases=[]",
        "train.steps=2",
        "checkpoint.every=1",
        "eval.size=0",
        "eval.samples=0",
        "threads=1",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        *RUN[3:],
        'update={name="sgd", lr=1.0}',
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = {}
    for label, cmd in (
        ("one", [sys.executable, "-m", "groupwise"]),
        (
            "two",
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "groupwise"],
        ),
    ):
        res = subprocess.run(
            [*cmd, *args, f"out={tmp_path / label}"], capture_output=True, text=True, env=env, timeout=600
        )
        assert res.returncode == 0, res.stderr[-3000:]
        from groupwise import checkpoint

        state = checkpoint.load(checkpoint.latest(tmp_path / label))
        out[label] = (
            state["components"]["rollout.rubricem_reflect"]["bank"],
            load_file(tmp_path / label / "final" / "model.safetensors"),
        )
    assert out["one"][0]["bank"] and out["one"][0] == out["two"][0]
    for name, w in out["one"][1].items():
        torch.testing.assert_close(out["two"][1][name], w, atol=1e-6, rtol=1e-5, msg=name)
