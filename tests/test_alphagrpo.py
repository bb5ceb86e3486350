"""AlphaGRPO (spec 27): DVReward's yes/no confidence and pooling, its template decomposer and judges
(programmatic, and the shipped ``judge`` model as a frozen role scored through the policy protocol),
the number_attrs / yes_no toys, FPR and the per-prompt advantage with its stage-1 baselines."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, paper_module, rollout_from, train_recorded

from groupwise.advantages.alphagrpo import fpr_rewards, per_prompt_advantages
from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rewards._common import RewardError
from groupwise.rewards.dvreward import ATTRIBUTES, decompose, dv_reward, sc_pq, verdict_word, yes_no_confidence

_number_attrs = paper_module("27_alphagrpo", "number_attrs")
problems, rows, satisfies = _number_attrs.problems, _number_attrs.rows, _number_attrs.satisfies


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _close(actual, expected, atol=1e-4):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


# ---------------------------------------------------------------------------------------------- yes/no confidence
def test_yes_no_confidence_spec_numbers():
    assert yes_no_confidence({"yes": math.log(0.6), "no": math.log(0.2)}, "yes") == pytest.approx(0.75, abs=1e-12)
    # neither in the top-5: the text
    assert yes_no_confidence({"maybe": math.log(0.5), "The": math.log(0.3)}, "Yes.") == 1.0
    assert yes_no_confidence({"maybe": -0.1}, "no") == 0.0


def test_yes_no_confidence_normalises_and_sums_token_texts():
    pairs = [(" Yes", math.log(0.3)), ("yes.", math.log(0.1)), ("NO", math.log(0.1)), ("nope", math.log(0.4))]
    assert yes_no_confidence(pairs, "no") == pytest.approx(0.4 / 0.5, abs=1e-12)  # "nope" is neither word
    assert yes_no_confidence([("yes", -math.inf), ("no", math.log(0.2))], "yes") == 0.0  # -inf adds nothing
    assert yes_no_confidence([("yes", -math.inf), ("no", -math.inf)], "Yes!") == 1.0  # both zero: the answer text
    # binary: the answer only
    assert yes_no_confidence({"yes": math.log(0.6), "no": math.log(0.2)}, "no", binary=True) == 0.0


def test_prefix_match_for_split_words():
    assert (
        verdict_word("y", "prefix") == "yes"
        and verdict_word(" N", "prefix") == "no"
        and verdict_word("ye", "prefix") == "yes"
    )
    assert (
        verdict_word("y", "word") is None
        and verdict_word(" ", "prefix") is None
        and verdict_word("x", "prefix") is None
    )
    assert yes_no_confidence(
        [("y", math.log(0.5)), ("n", math.log(0.25)), ("0", math.log(0.25))], "y", match="prefix"
    ) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="match"):
        yes_no_confidence({}, "yes", match="fuzzy")


def test_word_match_falls_back_to_answer_text_y_is_not_yes():
    assert yes_no_confidence([("y", math.log(0.9))], "y", match="word") == 0.0


# ---------------------------------------------------------------------------------------------- pooling
SEM, QUAL = [0.75, 0.25, 1.0], [0.5, 1.0]


def test_dv_reward_spec_numbers():
    sc, pq = sc_pq(SEM, QUAL)
    assert sc == pytest.approx(0.666667, abs=1e-6) and pq == pytest.approx(0.75, abs=1e-12)
    assert dv_reward(SEM, QUAL) == pytest.approx(0.70711, abs=1e-5)  # geometric is the default
    assert dv_reward(SEM, QUAL, "mean") == pytest.approx(0.70833, abs=1e-5)
    assert dv_reward(SEM, QUAL, "sum_mean") == pytest.approx(0.7, abs=1e-12)
    assert dv_reward(SEM, QUAL, "holistic") == 0.0  # 0.25 < 0.5: one verdict, not every question passes
    assert dv_reward([0.9, 0.5], [0.7], "holistic") == 1.0


def test_dv_reward_empty_lists_count_as_one():
    assert sc_pq([], []) == (1.0, 1.0)
    assert dv_reward([], [0.25]) == pytest.approx(0.5) and dv_reward([0.36], []) == pytest.approx(0.6)
    assert dv_reward([], [], "sum_mean") == 1.0
    with pytest.raises(ValueError, match="method"):
        dv_reward(SEM, QUAL, "median")


# --------------------------------------------------------------------------------------- decomposer, programmatic judge
def test_decomposer_questions_and_margins():
    sem, qual = decompose(" 52", ["even", "gt50", "ends5"])
    assert [q for q, _ in sem] == ["Is 52 even?", "Is 52 greater than 50?", "Does 52 end in 5?"]
    assert [m for _, m in sem] == [1.0, pytest.approx(0.3), -1.0]
    assert [q for q, _ in qual] == ["Is 52 a whole number?", "Is 52 a two-digit number?"] and [m for _, m in qual] == [
        1.0,
        1.0,
    ]
    sem, qual = decompose("5x", ["odd"])
    assert sem == [("Is 5x odd?", -1.0)] and [m for _, m in qual] == [-1.0, -1.0]  # not an integer: every answer no


def test_programmatic_reward_by_hand():
    r = build("reward", "dv_reward")
    got = r(["p"] * 4, ["52", "x", "7", "55"], attrs=["even,gt50", "even", None, "odd,ends5,gt50"])
    yes, no = sig(4.0), sig(-4.0)
    want_52 = math.sqrt((yes + sig(4 * 0.3)) / 2 * yes)  # SC = (even, >50 at margin 0.3) / 2, PQ = both quality yes
    want_55 = math.sqrt((yes + yes + sig(4 * 0.9)) / 3 * yes)
    # no integer: every c = sigmoid(-4)
    assert got[0] == pytest.approx(want_52, abs=1e-9) and got[1] == pytest.approx(no, abs=1e-9)
    assert got[2] is None and got[3] == pytest.approx(want_55, abs=1e-9)
    metrics = {}
    r(["p"], ["7"], attrs=["even,lt50"], log_metric=lambda k, v: metrics.__setitem__(k, v))
    assert metrics["dv_sat"] == 0.5 and metrics["dv_sc"] == pytest.approx((no + sig(4 * 8.5)) / 2)
    assert metrics["dv_pq"] == pytest.approx((yes + no) / 2)  # 7 is a whole number, not two-digit
    # a huge number: margins of ±2e11 (lt50) saturate the sigmoid instead of overflowing exp
    big = r(["p"], ["999999999999"], attrs=["lt50"])[0]
    assert big == pytest.approx(math.sqrt(0.0 * (yes + no) / 2), abs=1e-12)  # SC = P(yes) = 0 exactly


def test_reward_config_errors():
    for bad, match in [
        ({"method": "max"}, "method"),
        ({"judge": "gpt"}, "judge"),
        ({"template": "Answer:"}, "question"),
        ({"top_logprobs": 0}, "top_logprobs"),
        ({"k": 0.0}, "k="),
        ({"match": "x"}, "match"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build("reward", "dv_reward", **bad)
    with pytest.raises(RewardError, match="unknown attribute"):
        build("reward", "dv_reward")(["p"], ["5"], attrs=["prime"])
    with pytest.raises(RewardError, match="never given its model"):
        build("reward", "dv_reward", judge="role:judge")(["p"], ["5"], attrs=["odd"])
    with pytest.raises(ConfigError, match="frozen = true"):
        build("reward", "dv_reward", judge="role:judge").use_models({})


# --------------------------------------------------------------------------------- LM judge through the policy protocol
class FakeJudge:
    """A policy whose next-token distribution after a question is fixed per question (protocol check)."""

    texts = ["<eos>", "y", "n", "0", "Yes"]

    def __init__(self):
        self.seen = []

    def encode(self, prompt):
        self.seen.append(prompt)
        return [len(self.seen)]  # one token: the question's index + 1

    def token_texts(self):
        return self.texts

    def scoring_models(self, with_reference):
        import contextlib

        return {"policy": lambda: contextlib.nullcontext("module")}

    def score(self, module, rollout, quantities):
        assert (
            module == "module"
            and quantities == ["logprobs"]
            and tuple(rollout.actions.shape) == (len(rollout.prompt_ids), 1, 1)
        )
        # [2,V]: question 1 leans yes, question 2 no
        p = torch.tensor([[0.0, 0.5, 0.25, 0.2, 0.05], [0.0, 0.1, 0.6, 0.3, 0.0]])
        rows = torch.stack([p[(ids[0] - 1) % 2] for ids in rollout.prompt_ids])  # [N,V]
        return {"logprobs": rows.clamp(min=1e-30).log()[:, None, None, :]}  # [N,1,1,V]


def test_lm_judge_asks_each_question_once_through_score():
    judge = FakeJudge()
    r = build("reward", "dv_reward", judge="role:judge", match="prefix", top_logprobs=3, template="Q: {question} A:")
    r.use_models({"judge": judge, "other": None})
    # 3 questions: even (q1, yes-leaning), whole number (q2), two-digit (q3 = like q1)
    (got,) = r(["p"], ["52"], attrs=["even"])
    assert judge.seen == ["Q: Is 52 even? A:", "Q: Is 52 a whole number? A:", "Q: Is 52 a two-digit number? A:"]
    c1 = 0.5 / 0.75  # top-3 of row 1: y 0.5, n 0.25, 0 0.2 -> "Yes" (0.05) is not in the top 3
    c2 = 0.1 / 0.7
    assert got == pytest.approx(math.sqrt(c1 * (c2 + c1) / 2), abs=1e-6)


JUDGE_ROLE = 'roles.judge={frozen=true, model={path="judge"}}'


@pytest.fixture(scope="module")
def judge_lm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.policy.lm import resolve_model_path

    path = resolve_model_path("judge")
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


def first_token_confidence(tokenizer, model, question: str, k: int = 5) -> float:
    """The judge's c_q computed here, with transformers directly (independent of the reward's path)."""
    ids = tokenizer(f"{question} Answer yes or no:", return_tensors="pt").input_ids
    with torch.no_grad():
        logq = model(ids).logits[0, -1].float().log_softmax(-1)  # [V]
    top = logq.topk(k)
    texts = [tokenizer.decode([i]) for i in top.indices.tolist()]
    p = {"yes": 0.0, "no": 0.0}
    for text, v in zip(texts, top.values.tolist()):
        w = text.strip().lower()
        if w and "yes".startswith(w) and not "no".startswith(w):
            p["yes"] += math.exp(v)
        elif w and "no".startswith(w) and not "yes".startswith(w):
            p["no"] += math.exp(v)
    return (
        p["yes"] / (p["yes"] + p["no"])
        if p["yes"] + p["no"] > 0
        else float(texts[0].strip().lower() in ("y", "ye", "yes"))
    )


def test_shipped_judge_answers_the_held_out_questions(judge_lm):
    yes_no_rows = paper_module("27_alphagrpo", "yes_no").rows

    tokenizer, model = judge_lm
    test = yes_no_rows("test", 0)
    right = sum((first_token_confidence(tokenizer, model, r["question"]) > 0.5) == (r["answer"] == "yes") for r in test)
    assert right / len(test) >= 0.9  # measured at build: see models/judge/build.json


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_with_the_frozen_judge_role(tmp_path, objective, judge_lm):
    rows_, seen = train_recorded(
        tmp_path,
        objective,
        'data.task="number_attrs"',
        JUDGE_ROLE,
        'rewards=[{name="dv_reward", judge="role:judge", match="prefix"}]',
        'advantage.estimator="alphagrpo"',
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=3",
    )
    tokenizer, model = judge_lm
    for batch in seen:
        for b, meta in enumerate(batch.meta):
            for g, text in enumerate(batch.completions[b]):
                sem, qual = decompose(text, meta["attrs"].split(","))
                want = dv_reward(
                    [first_token_confidence(tokenizer, model, q) for q, _ in sem],
                    [first_token_confidence(tokenizer, model, q) for q, _ in qual],
                )
                # the run's reward is the judge's, asked here
                assert float(batch.rewards[b, g]) == pytest.approx(want, abs=1e-5)
        ids = [int(i) for i in batch.prompt_index for _ in range(batch.shape[1])]
        want = per_prompt_advantages(batch.rewards.reshape(-1), ids, valid=batch.group_valid.reshape(-1)).reshape(
            batch.shape[:2]
        )
        torch.testing.assert_close(batch.advantages, want.float())
    assert all(0.0 <= r["reward_metric/dv_sat"] <= 1.0 for r in rows_)


def test_two_steps_programmatic_judge_and_gaussian_noise(tmp_path):
    _, seen = train_recorded(
        tmp_path,
        "ppo_clip",
        'data.task="number_attrs"',
        'rewards=[{name="dv_reward", method="holistic"}, {name="gaussian_noise", sigma=0.1}]',
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=3",
        steps=1,
    )
    batch = seen[0]
    holistic = batch.reward_parts[..., 0]  # [B,G]
    assert set(holistic.flatten().tolist()) <= {0.0, 1.0}
    for b, meta in enumerate(batch.meta):
        for g, text in enumerate(batch.completions[b]):
            n = text.strip()
            ok = n.isdigit() and 10 <= int(n) <= 99 and satisfies(int(n), meta["attrs"].split(","))
            assert float(holistic[b, g]) == float(ok)


# ---------------------------------------------------------------------------------------------- toys
def test_number_attrs_task():
    assert len(problems()) == 29 and all(not ({"even", "ends5"} <= set(k)) for k in problems())
    train, test = rows("train", 0), rows("test", 0)
    assert len(train) == 20 and len(test) == 9 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train + test:
        keys = r["attrs"].split(",")
        assert r["prompt"] == "number " + " ".join(ATTRIBUTES[k][0] for k in keys) + "=" and satisfies(
            int(r["answer"]), keys
        )
    assert rows("train", 5, seed=1) != rows("train", 5, seed=2)
    # the task's default: 1 exactly when every attribute holds
    task_reward = build("reward", "dv_reward", method="holistic")
    assert task_reward(["p"] * 3, ["52", "51", "152"], attrs=["even,gt50"] * 3) == [1.0, 0.0, 0.0]


def test_yes_no_task_labels():
    yes_no_rows = paper_module("27_alphagrpo", "yes_no").rows

    train, test = yes_no_rows("train", 0), yes_no_rows("test", 0)
    assert len(train) == 1280 and len(test) == 320 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    row = next(r for r in train + test if r["question"] == "Is 45 divisible by 3?")
    assert row == {
        "prompt": "Is 45 divisible by 3? Answer yes or no:",
        "answer": "yes",
        "question": "Is 45 divisible by 3?",
    }
    assert next(r for r in train + test if r["question"] == "Is 50 greater than 50?")["answer"] == "no"
    three = [
        r for r in train + test if r["question"].endswith("a two-digit number?") and len(r["question"].split()[1]) == 3
    ]
    assert len(three) == 100 and all(r["answer"] == "no" for r in three)


# ---------------------------------------------------------------------------------------------- FPR and advantages
def test_fpr_spec_numbers():
    got = fpr_rewards(torch.tensor([[0.5, 0.25, 0.3, 0.7]]), torch.tensor([[0.3, 0.3, 0.3, 0.3]]))
    _close(got, [[0.5, 0.3, 0.3, 0.7]], atol=1e-7)
    _close(per_prompt_advantages(got.reshape(-1), ["p"] * 4), [0.3013, -0.9040, -0.9040, 1.5066])
    # different initial rewards: a non-improving row gets the group's LOWEST initial reward
    _close(fpr_rewards(torch.tensor([[0.4, 0.6]]), torch.tensor([[0.5, 0.2]])), [[0.2, 0.6]], atol=1e-7)


def test_group_mean_tracker_and_anchor():
    _close(
        per_prompt_advantages(torch.tensor([1.0, 3.0]), ["a", "a"], {"a": 2.0}, "group_mean"),
        [-1 / (1 + 1e-4), 1 / (1 + 1e-4)],
        atol=1e-9,
    )
    # anchor: baseline max(2.5, mean 2) = 2.5, d = [-1.5, 0.5], scale sqrt(1.25 + 1e-8)
    _close(
        per_prompt_advantages(torch.tensor([1.0, 3.0]), ["a", "a"], {"a": 2.5}, "grpo_anchor"),
        [-1.5 / math.sqrt(1.25 + 1e-8), 0.5 / math.sqrt(1.25 + 1e-8)],
        atol=1e-9,
    )
    # anchor below the mean: the mean is the baseline, as plain centring with an RMS scale
    _close(
        per_prompt_advantages(torch.tensor([1.0, 3.0]), ["a", "a"], {"a": 0.0}, "grpo_anchor"), [-1.0, 1.0], atol=1e-6
    )
    # two prompts are normalised apart; a constant prompt is exactly 0
    _close(
        per_prompt_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), ["a", "a", "b", "b"]),
        [-1 / (1 + 1e-4), 1 / (1 + 1e-4), 0, 0],
        atol=1e-9,
    )
    with pytest.raises(ValueError, match="group_mean"):
        per_prompt_advantages(torch.tensor([1.0]), ["a"], None, "group_mean")


def _batch(rewards, prompt_index, stage1=None, valid=None):
    r = torch.tensor(rewards, dtype=torch.float32)
    ro = rollout_from(torch.zeros(*r.shape, 2), rewards=r, prompt_index=torch.tensor(prompt_index))
    if stage1 is not None:
        ro.set_extra("stage1_reward", torch.tensor(stage1, dtype=torch.float32), "group")
    if valid is not None:
        ro.group_valid = torch.tensor(valid, dtype=torch.bool)
    return ro


def test_estimator_fpr_and_baselines_on_a_batch():
    est = build("advantage", "alphagrpo", fpr=True)
    assert est.rollout_extras == ("stage1_reward",) and build("advantage", "alphagrpo").rollout_extras == ()
    adv = est(_batch([[0.5, 0.25, 0.3, 0.7]], [0], stage1=[0.3]), info_for(2))
    _close(adv, [[0.3013, -0.9040, -0.9040, 1.5066]])
    # no refinement improved: every reward becomes 0.3, a constant group, 0 (the paper skips such a step)
    _close(est(_batch([[0.1, 0.3, 0.2, 0.0]], [0], stage1=[0.3]), info_for(2)), [[0, 0, 0, 0]], atol=0)
    gm = build("advantage", "alphagrpo", baseline="group_mean")
    _close(gm(_batch([[1.0, 3.0]], [7], stage1=[2.0]), info_for(2)), [[-1 / (1 + 1e-4), 1 / (1 + 1e-4)]], atol=1e-6)
    with pytest.raises(ValueError, match="stage1_reward"):
        gm(_batch([[1.0, 3.0]], [7]), info_for(2))


def test_estimator_pools_groups_of_one_prompt_and_skips_invalid_rows():
    ro = _batch([[1.0, 2.0], [3.0, 4.0], [0.0, 9.0]], [5, 5, 6], valid=[[True, True], [True, True], [True, False]])
    pooled = build("advantage", "alphagrpo")(ro, info_for(2))  # prompt 5: [1,2,3,4] mean 2.5, std sqrt(1.25)
    s = math.sqrt(1.25) + 1e-4
    # prompt 6: one valid row -> 0, the invalid one 0
    _close(pooled, [[-1.5 / s, -0.5 / s], [0.5 / s, 1.5 / s], [0.0, 0.0]], atol=1e-6)
    apart = build("advantage", "alphagrpo", by="group")(ro, info_for(2))
    _close(apart, [[-0.5 / 0.5001, 0.5 / 0.5001], [-0.5 / 0.5001, 0.5 / 0.5001], [0.0, 0.0]], atol=1e-6)
    ro.rewards[0, 0] = float("nan")
    assert build("advantage", "alphagrpo")(ro, info_for(2))[0, 0] == 0


def test_estimator_config_errors():
    for bad in ({"baseline": "median"}, {"by": "batch"}, {"eps": 0.0}):
        with pytest.raises(ValueError):
            build("advantage", "alphagrpo", **bad)
