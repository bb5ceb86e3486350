"""FBOS-RL (spec 02): the feedback verifier, the feedback-augmented prompt, and the fbos strategy's
batch (EPA groups under the original prompt, ECC groups under their FAPs) — by hand on a scripted
rollout context, and end to end through the trainer."""

from __future__ import annotations

import pytest
import torch
from test_trainer import make_trainer

from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rewards.feedback import feedback_text
from groupwise.rollout.fbos import TEMPLATE, build_fap
from groupwise.types import Rollout, StepInfo


def test_feedback_text_by_mode_and_the_reward_logs_it():
    assert feedback_text("135", "135", "hint") == ""
    assert feedback_text("134", "135", "hint") == "wrong: expected 3 digits, the last one is 5"
    assert feedback_text("134", "135", "answer") == "wrong: the answer is 135"
    assert feedback_text("abc", "135", "answer") == "the answer is not a number"
    logged = {}
    reward = build("reward", "exact_feedback")
    scores = reward(["1+2="], ["3 "], answer=["3"], log_extra=lambda column, values: logged.update({column: values}))
    assert scores == [1.0] and logged == {"feedback": [""]}
    with pytest.raises(ConfigError, match="modes: hint, answer, verdict, reference"):
        build("reward", "exact_feedback", mode="loud")


def test_build_fap_places_the_feedback_verbatim():
    text = build_fap("7+8=", "14", "wrong: expected 2 digits, the last one is 5")
    assert (
        text == "7+8=\n\nPrevious attempt:\n14\n\nFeedback:\nwrong: expected 2 digits, the last one is 5\n\nTry again."
    )
    assert build_fap("7+8=", "14", "f", "{completion}?{feedback}|{prompt}") == "14?f|7+8="
    chat = build_fap([{"role": "user", "content": "7+8="}], "14", "wrong")
    assert chat[1:] == [{"role": "assistant", "content": "14"}, {"role": "user", "content": "wrong\nTry again."}]
    assert TEMPLATE.count("{") == 3


def _rows(keys, rewards, texts, prompts, feedback=None):
    """A scored batch: one group per key, one-token rows (token 20 + row index)."""
    B, G = len(keys), len(rewards[0])
    info = [[{"extra": {"feedback": f}} for f in fb] for fb in feedback] if feedback else []
    return Rollout(
        prompt_ids=prompts,
        actions=(20 + torch.arange(G)).repeat(B, 1)[..., None],
        mask=torch.ones(B, G, 1, dtype=torch.bool),
        group_valid=torch.ones(B, G, dtype=torch.bool),
        truncated=torch.zeros(B, G, dtype=torch.bool),
        prompt_index=torch.tensor(keys),
        meta=[{"prompt": "7+8=", "answer": "15"} for _ in keys],
        completions=texts,
        rewards=torch.tensor(rewards),
        info=info,
    )


class Scripted:
    """A rollout context that answers the fbos strategy's two rounds with given batches."""

    batch_size, group_size, max_rounds = 1, 4, 1

    def __init__(self, step=0):
        self.requests, self.step = [], step
        self.policy = type("P", (), {"encode": staticmethod(lambda text: [ord(c) for c in text])})()

    def draw(self, n, round_=0):
        return [5]

    def rollout(self, requests, round_=0):
        self.requests.append(requests)
        if len(self.requests) == 1:  # the first round: both rows wrong, with feedback
            return _rows([5], [[0.0, 0.0]], [["14", "16"]], [[1, 2]], [["wrong: a", "wrong: b"]])
        # guided: one right, one wrong
        return _rows([5, 5], [[1.0], [0.0]], [["15"], ["13"]], [r.prompt for r in requests])

    def keep(self, batch):
        return torch.ones(batch.shape[0], dtype=torch.bool)

    def info(self, round_=0):
        return StepInfo(step=self.step, seed=0, max_new_tokens=4)


def test_fbos_batch_by_hand_and_the_epa_advantage():
    ctx = Scripted()
    batch = build("rollout", "fbos", initial=2, feedback_rows=2)(ctx)
    guided = ctx.requests[1]
    faps = [build_fap("7+8=", "14", "wrong: a"), build_fap("7+8=", "16", "wrong: b")]
    assert [r.prompt for r in guided] == [[ord(c) for c in f] for f in faps] and [r.offset for r in guided] == [2, 3]
    # EPA group: the two failed rows and the two guided rows, all under the original prompt;
    # ECC group: the guided rows under their FAPs
    assert batch.shape[:2] == (2, 4) and batch.prompt_ids[0] == [1, 2]
    assert batch.rewards[0].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert batch.rewards[1, :2].tolist() == [1.0, 0.0] and batch.group_valid[1].tolist() == [True, True, False, False]
    assert batch.ctx[0] == [[1, 2]] * 4 and batch.ctx[1][:2] == [r.prompt for r in guided]
    # the EPA group's guided rows were sampled under their FAPs and are flagged injected;
    # the ECC rows are trained under the FAP they were sampled under
    assert batch.behav_ctx[0] == [[], [], guided[0].prompt, guided[1].prompt] and batch.behav_ctx[1] == [[]] * 4
    assert batch.row_flags["injected"].tolist() == [[False, False, True, True], [False] * 4]
    assert batch.behaviour_contexts()[1][:2] == batch.ctx[1][:2]
    # spec 02's unit test: population-std GRPO on [0, 0, 1, 0]: mean 0.25, std 0.433 → [−0.577, −0.577, 1.732, −0.577]
    adv = build("advantage", "grpo", std="population", eps=0.0)(batch, ctx.info())
    torch.testing.assert_close(adv[0], torch.tensor([-1 / 3**0.5, -1 / 3**0.5, 3**0.5, -1 / 3**0.5]))
    plain = build("advantage", "grpo", std="population")(batch.select([0]).regroup([[(0, 0), (0, 1)]]), ctx.info())
    assert plain.abs().sum() == 0  # GRPO on the failed pair alone: no signal
    assert ctx.requests[0][0].n == 2


def test_alternate_mode_trains_epa_on_even_steps_and_ecc_on_odd_steps():
    even = build("rollout", "fbos", initial=2, feedback_rows=2, mode="alternate")(Scripted(step=0))
    odd = build("rollout", "fbos", initial=2, feedback_rows=2, mode="alternate")(Scripted(step=1))
    assert (
        even.rewards.tolist() == [[0.0, 0.0, 1.0, 0.0]]
        and not even.ctx
        and even.row_flags["injected"].tolist() == [[False, False, True, True]]
    )
    assert odd.rewards.tolist() == [[1.0, 0.0]] and len(odd.ctx[0]) == 2


def test_fbos_through_the_trainer_scores_guided_rows_against_the_original_answer(tmp_path):
    trainer = make_trainer(
        tmp_path,
        'rollout.name="fbos"',
        'rollout.params={initial=2, feedback_rows=2, template="{completion}: {feedback}\\n{prompt}"}',
        'rewards=[{name="exact_feedback"}]',
        "rollout.prompts_per_step=8",
        "train.steps=1",
        "eval.size=0",
    )
    seen = {}
    prepare = trainer.prepare
    trainer.prepare = lambda batch: seen.setdefault("batch", prepare(batch))
    row = trainer.run_step()
    batch = seen["batch"]
    assert row["fbos/failing_groups"] > 0, "the seed must give the test an all-fail group"
    n_fail = round(row["fbos/failing_groups"] * 8)
    assert batch.shape[0] == 8 + n_fail and batch.shape[1] == 4
    # ECC rows: the context is the FAP, which quotes the feedback verbatim; the reward is exact vs the row's answer
    for b in range(8, 8 + n_fail):
        for g in range(2):
            text = trainer.policy.tokenizer.decode(batch.ctx[b][g])
            assert ": wrong" in text or ": the answer is not a number" in text
            assert text.endswith(batch.meta[b]["prompt"])
            assert float(batch.rewards[b, g]) == float(batch.completions[b][g].strip() == str(batch.meta[b]["answer"]))
    assert torch.isfinite(torch.tensor(row["loss"]))
