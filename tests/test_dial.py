"""DIAL (spec 26): the toy ``drive2d`` (``papers/26_dial/drive2d.py``), the intent-balanced rollout
``multi_intent`` (``rollout/multi_intent.py``) and the recipe ``dial`` — the spec's unit tests worked
by hand, the strategy's groups and held-out measures, world size 1 = 2 and kill-and-resume."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch
from helpers import assert_nets_close, assert_resume_is_exact, train_one_and_two_ranks

from groupwise.advantages.grpo import group_normalize
from groupwise.build import build
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.flow_sde import sde_step_with_logprob
from groupwise.modalities.gauss import cfg_velocity, gauss_logp
from groupwise.rollout.context import check_strategy
from groupwise.rollout.multi_intent import MultiIntent, group_intents, sector_entropy
from groupwise.trainer import Trainer
from groupwise.types import StepInfo

drive2d = importlib.import_module("groupwise.papers.26_dial.drive2d")
FAST = [
    'phases=[{name="sft", steps=5, batch_size=32, p_uncond=0.1}]',
    "rollout.prompts_per_step=2",
    "eval.size=2",
    "threads=1",
]


def test_the_specs_cfg_and_gaussian_step_cases():
    # CFG: v_u = [0,0], v_c = [1,2]: w = 2 → [0,0] + 2·[1,2] = [2,4]; w = 1 → v_c; w = 0 → v_u
    v_u, v_c = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 2.0]])
    assert cfg_velocity(v_u, v_c, 2.0).tolist() == [[2.0, 4.0]]
    assert cfg_velocity(v_u, v_c, 1.0).tolist() == [[1.0, 2.0]] and cfg_velocity(v_u, v_c, 0.0).tolist() == [[0, 0]]
    # μ = [0,0], x' = [0.1,−0.2], σ = 0.5, summed over d = 2:
    # −(0.01 + 0.04)/(2·0.25) − 2·log 0.5 − log 2π = −0.1 + 1.386294 − 1.837877 = −0.551583
    logp = gauss_logp(torch.tensor([[0.1, -0.2]]), torch.zeros(1, 2), 0.5, reduce="sum")
    assert float(logp) == pytest.approx(-0.55158, abs=1e-5)


def test_the_specs_group_composition_and_its_advantages_over_all_16():
    intents = group_intents(8, 2)
    assert intents == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # each intent exactly twice
    # rewards: 1 for the two rows of intent 3, 0 elsewhere → mean 2/16 = 0.125; std (population,
    # the estimator's "population") = sqrt(0.125·0.875) = 0.330719; A = 0.875/0.330719 = 2.645751 on
    # intent 3, −0.125/0.330719 = −0.377964 on the 14 others: one normalisation over all 16 rows
    rewards = torch.tensor([[1.0 if k == 3 else 0.0 for k in intents]])  # [1,16]
    adv = group_normalize(rewards, torch.ones(1, 16, dtype=torch.bool), "group", 0, 0.0)  # [1,16] ddof 0, eps 0
    assert adv[0, 6].item() == pytest.approx(2.645751, abs=1e-5) and adv[0, 7].item() == adv[0, 6].item()
    assert adv[0, 0].item() == pytest.approx(-0.377964, abs=1e-5) and float(adv.sum()) == pytest.approx(0, abs=1e-5)


def test_intent_rule_and_demonstrations_by_hand():
    # the heading sector (width 45°, centred on 45°·k): [1,0] 0°; [0,1] 90° → 2; [−1,0] 180° → 4;
    # [0,−1] −90° → 6; [1,0.4] 21.8° → 0; [1,0.42] 22.8° → 1
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0], [1.0, 0.4], [1.0, 0.42]])
    assert drive2d.intent_of(x).tolist() == [0, 2, 4, 6, 0, 1]
    rows = drive2d.scene_rows(200, seed=3)
    targets = torch.tensor([r["target"] for r in rows])  # [200,2]
    assert [len(r["prompt"]) for r in rows] == [4] * 200 and {r["intent"] for r in rows} == set(range(8))
    # the rule-derived intent is the demo's heading sector; each demo ends about `reach` = 2 away
    assert drive2d.intent_of(targets).tolist() == [r["intent"] for r in rows]
    assert float((targets.norm(dim=-1) - 2).abs().max()) < 0.5


def test_the_rater_by_hand():
    obs = torch.tensor([[0.0, 2.0, 1.0, 0.0]])  # obstacle at [0,2], goal heading 0
    x = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2 * math.cos(0.2), 2 * math.sin(0.2)], [1.5, 0.0]])
    score = drive2d.rater_score(x, obs.expand(4, 4)).tolist()
    # [2,0]: on the goal heading at the reach → 1·1 = 1; [0,2]: 90° off (heading exp(−(π/2)²/0.08) ≈ 4e-14),
    # and inside the obstacle → −1; 0.2 rad off at the reach: exp(−0.04/0.08) = exp(−0.5) = 0.606531;
    # [1.5,0]: on the heading, 0.5 short: exp(−0.25/(2·0.25)) = exp(−0.5) = 0.606531
    assert score == pytest.approx([1.0, -1.0, 0.606531, 0.606531], abs=1e-5)
    # the heading wraps: −3.1 rad and +3.1 rad from a goal at π are both 0.04159 rad off
    goal_pi = torch.tensor([[0.0, 9.0, -1.0, 0.0]])
    around = torch.tensor([[2 * math.cos(-3.1), 2 * math.sin(-3.1)], [2 * math.cos(3.1), 2 * math.sin(3.1)]])
    expected = math.exp(-((math.pi - 3.1) ** 2) / 0.08)
    assert drive2d.rater_score(around, goal_pi.expand(2, 4)).tolist() == pytest.approx([expected] * 2, abs=1e-5)


def test_sector_entropy_by_hand():
    # group 0: headings 0°, 0°, 90°, 90° → p = (1/2, 1/2) → log 2 = 0.693147; group 1: four sectors,
    # one valid row each and a padding row (not counted) → log 4 = 1.386294; group 2: all one sector → 0
    pts = torch.tensor(
        [
            [[1.0, 0.0], [2.0, 0.1], [0.0, 1.0], [0.1, 3.0], [1.0, 0.0]],
            [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0], [0.0, 1.0]],
            [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]],
        ]
    )
    valid = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    h = sector_entropy(pts, valid, 8).tolist()
    assert h == pytest.approx([math.log(2), math.log(4), 0.0], abs=1e-9)


class _Ctx:
    """A rollout context that records the requests (the strategy's groups)."""

    def __init__(self, group_size: int):
        self.batch_size, self.group_size, self.max_rounds = 2, group_size, 1
        self.requests = []

    def draw(self, n, round_=0):
        return list(range(n))

    def rollout(self, requests, round_=0):
        self.requests += requests
        requests = [dataclasses.replace(r, prompt=[r.key]) for r in requests]  # the context fills each row's prompt
        policy = FlowPolicy(condition_extras={"intent": 8}, cfg_w=2.0)
        out = policy.generate(requests, {}, StepInfo(step=0, seed=0, max_new_tokens=0))
        out.rewards = torch.zeros(out.shape[:2])
        return out

    def keep(self, batch):
        return torch.ones(batch.shape[0], dtype=torch.bool)


def test_the_strategy_asks_every_intent_per_intent_times_or_one_intent():
    ctx = _Ctx(16)
    batch = MultiIntent()(ctx)
    assert [r.extras["intent"] for r in ctx.requests] == [group_intents(8, 2)] * 2 and batch.shape[:2] == (2, 16)
    stored = batch.extras["flow_cond"][:, :, 0, -1]  # [B,G] the intent each row sampled (and is re-scored) under
    assert stored.tolist() == [[float(k) for k in group_intents(8, 2)]] * 2
    ctx = _Ctx(16)
    MultiIntent(mode="single")(ctx)
    assert [r.extras["intent"] for r in ctx.requests] == [[-1] * 16] * 2  # the baseline: unconditional
    with pytest.raises(ConfigError, match=r"group_size=12 must equal intents × per_intent = 8 × 2 = 16"):
        MultiIntent()(_Ctx(12))
    with pytest.raises(ConfigError, match="eval_n=12 must be >= 1 and, with eval_intents='balanced', a multiple"):
        MultiIntent(eval_n=12)


def test_check_strategy_pairs_the_policys_condition_with_the_strategy():
    policy = FlowPolicy(condition_extras={"intent": 8}, cfg_w=2.0)
    check_strategy(MultiIntent(), policy, [])  # it collects "intent"
    with pytest.raises(ConfigError, match=r"samples under the request extras \['intent'\]"):
        check_strategy(MultiIntent(extra="goal"), policy, [])


def test_the_recipe_fits_trains_and_evaluates_the_strategys_measures(tmp_path):
    from groupwise.run import Run

    cfg, _ = load_config("dial", [f'out="{tmp_path}"', *FAST, "train.steps=1"])
    trainer = Trainer(build(cfg))
    Run(trainer).train()
    import json

    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("best_of_16", "best_of_16_uncond", "reward_mean_uncond", "maneuver_entropy"):
        assert math.isfinite(summary[f"{key}_before"]) and math.isfinite(summary[f"{key}_after"]), key
    assert 0 <= summary["maneuver_entropy_after"] <= math.log(8) + 1e-9
    assert summary["best_of_16_after"] >= summary["reward_mean_uncond_after"] - 1.0  # scores lie in [−1, 1]


def test_the_rows_are_rescored_under_their_own_intent_and_guidance():
    """The recomputed log-prob of every stored step equals the sampler's (ratio 1 at the first update)."""
    policy = FlowPolicy(condition="vector", obs_dim=4, condition_extras={"intent": 8}, cfg_w=2.0, sde="all")
    from groupwise.types import Request

    rows = drive2d.scene_rows(3, seed=1)
    reqs = [
        Request(key=i, n=16, prompt=r["prompt"], extras={"intent": group_intents(8, 2)}) for i, r in enumerate(rows)
    ]
    out = policy.generate(reqs, {}, StepInfo(step=0, seed=2, max_new_tokens=0))
    torch.testing.assert_close(policy.forward(out)["logp"], out.logp_sampler, atol=1e-6, rtol=0)
    # and a wrong intent would not: the condition matters to the score
    out.extras["flow_cond"][..., -1] = (out.extras["flow_cond"][..., -1] + 1) % 8 * out.mask
    assert not torch.allclose(policy.forward(out)["logp"], out.logp_sampler, atol=1e-3)
    assert sde_step_with_logprob  # the Euler SDE step of Flow-GRPO is the kernel re-scored


def test_a_dial_run_resumes_exactly(tmp_path):
    """Kill-and-resume of a DIAL run (its CFG-dropout fit, then RL on intent-balanced groups) equals the
    uninterrupted run: the same weights and the same logged rewards."""

    def trainer(out):
        overrides = [f'out="{out}"', *FAST, "train.steps=4", "checkpoint.every=2"]
        return Trainer(build(load_config("dial", overrides)[0]))

    assert_resume_is_exact(trainer, tmp_path)


@pytest.mark.slow  # a torchrun pair (~20 s): make test-slow / test-dist; make test stays under 10 minutes
@pytest.mark.dist
def test_two_ranks_equal_one_process(tmp_path):
    """One DIAL step (SGD, lr 1) over 2 ranks equals one process: the same weights after it."""
    args = [
        "train",
        "dial",
        *FAST,
        "rollout.prompts_per_step=4",
        "train.steps=1",
        "eval.size=0",
        'update={name="sgd", lr=1.0}',
    ]
    one, two = (state["net"] for state in train_one_and_two_ranks(args, tmp_path, "flow_policy.pt", 300))
    assert_nets_close(one, two)
