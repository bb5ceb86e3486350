"""RubricEM (spec 39): stage rubric rewards, the stage-structured advantage (SS-GRPO), the rubric bank.

Hand numbers: the spec's unit test (G=3, K=2 stage scores) with population std; token maps on a
hand vocabulary whose tokens are whole tags; the rubric judge's item scores worked by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, rollout_from

from groupwise.advantages.rubricem import ss_grpo_advantages, stage_masks, stage_to_token_adv
from groupwise.errors import ConfigError
from groupwise.masked import group_normalize
from groupwise.registry import build
from groupwise.rubric_bank import RubricBank, meta_reward

SPEC = [[0.8, 1.0], [0.4, 0.5], [0.6, 0.0]]  # G=3 trajectories x K=2 stages (plan, answer)
R15 = math.sqrt(1.5)  # 1.2247: 0.2 / sqrt(0.08 / 3) and 0.5 / sqrt(0.5 / 3)
A_PLAN = 0.2 / (math.sqrt(0.08 / 3) + 1e-6)  # eps = 1e-6 on the population std
A_ANS = 0.5 / (math.sqrt(0.5 / 3) + 1e-6)

# hand vocabulary: every tag is one token; "" (id 0) is EOS / special
VOCAB = ["", "<p>", "</p>", "<a>", "</a>", "x", "y", " "]
P, P_, A, A_, X, Y, SP = 1, 2, 3, 4, 5, 6, 7


def close(got, want, atol=1e-6):
    torch.testing.assert_close(got.double(), torch.as_tensor(want, dtype=torch.float64), atol=atol, rtol=0.0)


# ---------------------------------------------------------------------------------------------- spec unit test
def test_spec_stage_advantages():
    scores = torch.tensor([SPEC], dtype=torch.float64)  # [1,3,2]
    adv = ss_grpo_advantages(scores, torch.ones(1, 3, 2, dtype=torch.bool))  # [1,3,2]
    close(adv, [[[A_PLAN, A_ANS], [-A_PLAN, 0.0], [0.0, -A_ANS]]])
    close(adv, [[[R15, R15], [-R15, 0.0], [0.0, -R15]]], atol=1e-4)  # the spec's printed 1.2247
    # trajectory 2: negative Plan credit, neutral Answer credit;
    # terminal GRPO on the answer score gives one value per row
    terminal = group_normalize(scores[..., 1], torch.ones(1, 3, dtype=torch.bool), "group", 0, 1e-6)  # [1,3]
    close(terminal, [[A_ANS, 0.0, -A_ANS]])
    assert adv[0, 1, 0] < 0 and adv[0, 1, 1] == 0


def test_mix_final_blends_in_the_final_stage():
    adv = ss_grpo_advantages(
        torch.tensor([SPEC], dtype=torch.float64), torch.ones(1, 3, 2, dtype=torch.bool), mix_final=0.5
    )
    # plan: 0.5 * A_plan + 0.5 * A_answer; answer: unchanged (its own advantage mixed with itself)
    close(adv, [[[0.5 * A_PLAN + 0.5 * A_ANS, A_ANS], [-0.5 * A_PLAN, 0.0], [-0.5 * A_ANS, -A_ANS]]])
    full = ss_grpo_advantages(
        torch.tensor([SPEC], dtype=torch.float64), torch.ones(1, 3, 2, dtype=torch.bool), mix_final=1.0, final=0
    )
    # λ = 1, final = plan: terminal GRPO on the plan score
    close(full, [[[A_PLAN, A_PLAN], [-A_PLAN, -A_PLAN], [0.0, 0.0]]])


def test_stage_without_verdict_and_constant_stage():
    scores = torch.tensor(
        [[[0.8, 1.0], [0.4, float("nan")], [0.6, 0.0]], [[0.5, 0.2], [0.5, 0.7], [0.5, 0.7]]], dtype=torch.float64
    )
    valid = torch.isfinite(scores)  # [2,3,2]
    adv = ss_grpo_advantages(scores, valid)
    # group 0, answer stage: rows 0 and 2 only (1.0, 0.0): mean 0.5, pop std 0.5 -> ±1/(1+2e-6); row 1 exactly 0
    # group 1: plan constant -> 0; answer (0.2, 0.7, 0.7): mean 0.5333, pop std sqrt(0.05556)
    sd = math.sqrt(((0.2 - 1.6 / 3) ** 2 + 2 * (0.7 - 1.6 / 3) ** 2) / 3) + 1e-6
    close(
        adv,
        [
            [[A_PLAN, 0.5 / 0.500001], [-A_PLAN, 0.0], [0.0, -0.5 / 0.500001]],
            [[0.0, (0.2 - 1.6 / 3) / sd], [0.0, (0.7 - 1.6 / 3) / sd], [0.0, (0.7 - 1.6 / 3) / sd]],
        ],
    )
    assert adv[1, :, 0].eq(0).all() and adv[0, 1, 1].item() == 0.0


# ---------------------------------------------------------------------------------------------- token maps
def _row(tokens, T=8):
    ids = torch.zeros(T, dtype=torch.long)
    ids[: len(tokens)] = torch.tensor(tokens)
    mask = torch.zeros(T, dtype=torch.bool)
    mask[: len(tokens)] = True
    return ids, mask


def test_stage_masks_and_token_advantage():
    rows = [
        _row([P, X, Y, P_, SP, A, X, A_]),
        _row([X, A, Y, A_, 0]),
        _row([P, X, A, Y]),
    ]  # row 2: no </p>, cut: <p> runs to the end
    actions, mask = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])  # [3,8]
    m = stage_masks(actions, mask, VOCAB, [["<p>", "</p>"], ["<a>", "</a>"]])  # [3,2,8]
    assert m[0, 0].tolist() == [False, True, True, False, False, False, False, False]
    assert m[0, 1].tolist() == [False, False, False, False, False, False, True, False]
    assert m[1, 0].tolist() == [False] * 8 and m[1, 1].tolist() == [
        False,
        False,
        True,
        False,
        False,
        False,
        False,
        False,
    ]
    assert m[2, 0].tolist() == [False, True, True, True, False, False, False, False] and not m[2, 1].any()
    adv = torch.tensor([[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0]], dtype=torch.float64)  # [3,2]
    tok = stage_to_token_adv(adv, m, outside=torch.tensor([7.0, 8.0, 9.0]))  # [3,8]
    close(tok, [[7, 1, 1, 7, 7, 7, -2, 7], [8, 8, 0.5, 8, 8, 8, 8, 8], [9, -1, -1, -1, 9, 9, 9, 9]])
    close(stage_to_token_adv(adv, m)[0], [0, 1, 1, 0, 0, 0, -2, 0])


def _rollout(outside_pad=True):
    """B=1, G=3: rows 'p-stage then a-stage' with the spec's scores as reward_parts (plan, answer)."""
    rows = [_row([P, X, P_, A, Y, A_, 0]), _row([P, Y, P_, A, X, A_, 0]), _row([P, X, Y, P_, A, A_])]
    actions = torch.stack([r[0] for r in rows])[None]  # [1,3,8]
    mask = torch.stack([r[1] for r in rows])[None]  # [1,3,8]
    parts = torch.tensor([SPEC], dtype=torch.float32)  # [1,3,2]
    return rollout_from(torch.zeros(1, 3, 8), None, mask, actions=actions, reward_parts=parts, rewards=parts.sum(-1))


def _component(**kw):
    comp = build("advantage", "rubricem", stage_tags=[["<p>", "</p>"], ["<a>", "</a>"]], **kw)
    comp.use_vocabulary(VOCAB)
    return comp


def test_component_gives_each_stage_its_own_advantage():
    ro = _rollout()
    out = _component()(ro, info_for(8))  # [1,3,8]
    ap, aa = float(torch.tensor(A_PLAN, dtype=torch.float32)), A_ANS
    # float32 scores: 0.6 - mean(0.8, 0.4, 0.6) is not exactly 0 in float32-then-float64 -> tolerance 1e-5
    want = [[aa, ap, aa, aa, aa, aa, aa, 0], [0, -ap, 0, 0, 0, 0, 0, 0], [-aa, 0, 0, -aa, -aa, -aa, 0, 0]]
    want[2][1] = want[2][2] = 0.0  # row 2's plan tokens x, y: plan advantage 0
    close(out[0], want, atol=1e-5)
    zero_out = _component(outside="zero")(ro, info_for(8))[0]
    close(zero_out, [[0, ap, 0, 0, aa, 0, 0, 0], [0, -ap, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]], atol=1e-5)
    mean_out = _component(outside="mean")(ro, info_for(8))[0]
    assert mean_out[1, 0].item() == pytest.approx(-ap / 2, abs=1e-5) and mean_out[0, 7].item() == 0.0


def test_component_invalid_rows_masked_tokens_and_stage_parts():
    ro = _rollout()
    ro.group_valid = torch.tensor([[True, True, False]])
    ro.loss_mask = torch.ones(1, 3, 8, dtype=torch.bool)
    ro.loss_mask[0, 0, 1] = False  # an env token hole inside row 0's plan
    out = _component(outside="zero")(ro, info_for(8))[0]
    # two valid rows: plan (0.8, 0.4) -> ±0.2/(0.2+1e-6); answer (1.0, 0.5) -> ±0.25/(0.25+1e-6)
    p, a = 0.2 / 0.200001, 0.25 / 0.250001
    close(out, [[0, 0, 0, 0, a, 0, 0, 0], [0, -p, 0, 0, -a, 0, 0, 0], [0] * 8], atol=1e-5)
    # plan tokens read the answer column
    swapped = _component(outside="zero", stage_parts=[1, 0])(_rollout(), info_for(8))[0]
    close(swapped[:, 1], [A_ANS, 0.0, -A_ANS], atol=1e-5)
    with pytest.raises(ValueError, match="reward column 2"):
        _component(stage_parts=[0, 2])(_rollout(), info_for(8))


def test_without_reward_parts_it_is_population_grpo_on_every_token():
    ro = _rollout()
    ro.reward_parts = None
    ro.rewards = torch.tensor([[1.0, 0.0, 0.5]])
    out = _component()(ro, info_for(8))[0]  # [3,8]
    z = 0.5 / (math.sqrt(0.5 / 3) + 1e-6)
    want = torch.tensor([z, -z, 0.0], dtype=torch.float64)[:, None] * ro.mask[0].double()
    close(out, want, atol=1e-6)
    ro.reward_parts = ro.rewards[..., None].clone()  # one reward: the same
    close(_component()(ro, info_for(8))[0], want, atol=1e-6)
    ro.reward_parts = torch.stack([ro.rewards, ro.rewards], -1)  # [1,3,2] two rewards, three stages
    with pytest.raises(ValueError, match="reward column 2"):
        _three()(ro, info_for(8))


def _three():
    comp = build("advantage", "rubricem")
    comp.use_vocabulary(VOCAB)
    return comp


def test_config_errors_name_the_value():
    with pytest.raises(ConfigError, match="mix_final=1.5"):
        build("advantage", "rubricem", mix_final=1.5)
    with pytest.raises(ConfigError, match="stage_parts"):
        build("advantage", "rubricem", stage_parts=[0, 1])
    with pytest.raises(ConfigError, match="outside"):
        build("advantage", "rubricem", outside="both")
    with pytest.raises(ConfigError, match="final=3"):
        build("advantage", "rubricem", final=3)
    with pytest.raises(ValueError, match="vocabulary"):
        build("advantage", "rubricem")(_rollout(), info_for(8))


# ---------------------------------------------------------------------------------------------- the rubric judge
def test_stage_rubric_item_scores():
    ref = "<p>a=3 d=1</p><r>3+1</r><a>4</a>"
    plan = build("reward", "stage_rubric")
    got = plan(
        [""] * 5,
        ["<p>a=3 d=1</p>", "<p>a=3 d=2</p><a>4</a>", "<p>a=3 d=1 b=2</p>", "<r>3+1</r>", "<p>d=1 a=3</p>"],
        answer=[ref] * 5,
    )
    assert got == [1.0, 0.5, 2 / 3, 0.0, 0.0]  # exact; extra piece: 2 of max(2, 3); wrong order: no piece in place
    compute = build("reward", "stage_rubric", tags=["<r>", "</r>"])
    assert compute([""] * 3, ["<r>3+1</r>", "<r>3+", "<r>4</r>"], answer=[ref, ref, ref]) == [
        1.0,
        0.5,
        0.0,
    ]  # cut at the limit: '3' in place
    answer = build("reward", "stage_rubric", tags=["<a>", "</a>"], label="answer")
    assert answer([""] * 3, ["<a>4</a>", "<a>5</a>", "4"], answer=[ref, None, "no stages"]) == [1.0, None, None]
    with pytest.raises(ConfigError, match="judge"):
        build("reward", "stage_rubric", judge="lm")
    with pytest.raises(ConfigError, match="empty string"):
        build("reward", "stage_rubric", split="x*")


# ---------------------------------------------------------------------------------------------- the rubric bank
def test_rubric_bank_and_meta_reward():
    bank = RubricBank(capacity=2)
    bank.add("sum", "quote both facts")
    bank.add("sum", "check the sum")
    bank.add("sum", "quote both facts")  # moves to the front, stored once
    assert bank.retrieve("sum", 5) == ["quote both facts", "check the sum"]
    bank.add("sum", "third")
    assert bank.retrieve("sum", 5) == ["third", "quote both facts"] and len(bank) == 2
    assert bank.retrieve("other", 3) == [] and bank.retrieve("sum", 0) == []
    copy = RubricBank()
    copy.load_state_dict(bank.state_dict())
    assert copy.retrieve("sum", 2) == bank.retrieve("sum", 2) and copy.capacity == 8  # its own, not the state's
    assert (
        meta_reward(True, 0.75, 0.5) == 0.25
        and meta_reward(False, 0.75, 0.5) == 0.0
        and meta_reward(True, 0.2, 0.5) == pytest.approx(-0.3)
    )
    with pytest.raises(ValueError, match="capacity"):
        RubricBank(capacity=0)


# ---------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_stage_advantages_reach_the_surrogate_token_by_token(objective):
    """On-policy (ratio 1, inside the clip) each token's loss gradient is −A_t: the stage advantage, not the row's."""
    ro = _rollout()
    ro.advantages = _component()(ro, info_for(8))  # [1,3,8]
    logp = torch.full((1, 3, 8), -1.0, requires_grad=True)
    ro.logp_old = logp.detach().clone()
    values = build("objective", objective)(ro, {"logp": logp}, info_for(8))  # [1,3,8]
    (grad,) = torch.autograd.grad((values * ro.row_mask).sum(), logp)
    close(grad, -ro.advantages.double() * ro.row_mask, atol=1e-6)


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_trains_two_steps_with(tmp_path, objective):
    from helpers import train_recorded

    rewards = (
        'rewards=[{name="stage_rubric", tags=["<p>", "</p>"], label="plan"}, {name="stage_rubric", '
        'tags=["<r>", "</r>"], label="compute"}, {name="stage_rubric", tags=["<a>", "</a>"], label="answer"}]'
    )
    rows, seen = train_recorded(
        tmp_path,
        objective,
        'data.task="evidence"',
        rewards,
        'advantage.estimator="rubricem"',
        "rollout.max_new_tokens=12",
    )
    for row, batch in zip(rows, seen):
        assert batch.reward_parts.shape[-1] == 3 and batch.advantages.shape == batch.actions.shape
        assert (batch.advantages[~batch.row_mask] == 0).all()
        # no tag in 12 tokens of the untrained model ->
        # every token carries the answer stage's group z-score (outside = "final")
        valid = batch.group_valid & torch.isfinite(batch.rewards)
        z = group_normalize(
            torch.nan_to_num(batch.reward_parts[..., 2].double()),
            valid & torch.isfinite(batch.reward_parts[..., 2]),
            "group",
            0,
            1e-6,
        )
        inside = row["rubricem/stage_frac"] > 0
        if not inside:
            close(batch.advantages, (z[..., None] * batch.row_mask).float(), atol=1e-6)
        assert "reward/plan" in row and "reward/answer" in row


# ---------------------------------------------------------------------------------------------- LM judge (frozen role)
def test_stage_rubric_lm_judge_is_the_shipped_judges_own_confidence(tmp_path):
    """judge = role:judge: each reference item of the stage is one yes/no question to the shipped judge model;
    the score is the mean of its first-token yes-confidences, computed here with transformers directly."""
    from test_alphagrpo import JUDGE_ROLE, first_token_confidence
    from test_trainer import make_trainer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.policy.lm import resolve_model_path

    path = resolve_model_path("judge")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    reward_cfg = 'rewards=[{name="stage_rubric", tags=["<p>", "</p>"], judge="role:judge", label="plan"}]'
    trainer = make_trainer(tmp_path, 'data.task="evidence"', JUDGE_ROLE, reward_cfg, "eval.size=0")
    reward = trainer.reward_stage.scorers[0]
    ref = "<p>a=3 d=1</p><r>3+1</r><a>4</a>"
    got = reward(
        ["p"] * 4, ["<p>a=3 d=2</p><a>5</a>", "<a>4</a>", "<p></p>", "<p>a=3 d=1"], answer=[ref, ref, ref, None]
    )
    want = [
        (
            first_token_confidence(tokenizer, model, "Is a=3 in a=3 d=2?")
            + first_token_confidence(tokenizer, model, "Is d=1 in a=3 d=2?")
        )
        / 2,
        0.0,  # no plan stage: nothing asked
        (
            first_token_confidence(tokenizer, model, "Is a=3 in ?")
            + first_token_confidence(tokenizer, model, "Is d=1 in ?")
        )
        / 2,
        None,
    ]  # no reference: no verdict
    assert got[1] == 0.0 and got[3] is None
    assert got[0] == pytest.approx(want[0], abs=1e-5) and got[2] == pytest.approx(want[2], abs=1e-5)
    assert 0.0 < got[0] < 1.0 and got[0] != got[2]  # a soft verdict that reads the stage text
    # the programmatic judge on the same rows: 1 of 2 items, 0, 0, None
    assert build("reward", "stage_rubric")(
        ["p"] * 4, ["<p>a=3 d=2</p>", "<a>4</a>", "<p></p>", "x"], answer=[ref, ref, ref, None]
    ) == [0.5, 0.0, 0.0, None]


def test_stage_rubric_lm_judge_refused_without_its_role(tmp_path):
    from test_trainer import make_trainer

    from groupwise.rewards._common import RewardError

    with pytest.raises(ConfigError, match=r"names no frozen role.*roles\.judge"):
        make_trainer(
            tmp_path, 'data.task="evidence"', 'rewards=[{name="stage_rubric", judge="role:judge"}]', "eval.size=0"
        )
    with pytest.raises(RewardError, match="never given its model"):
        build("reward", "stage_rubric", judge="role:judge")(["p"], ["<p>a=3</p>"], answer=["<p>a=3</p>"])
    for bad, match in [
        ({"judge": "gpt"}, "judge"),
        ({"question": "Is {item} ok?"}, "stage"),
        ({"template": "Q"}, "question"),
        ({"match": "exact"}, "match"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build("reward", "stage_rubric", **bad)
