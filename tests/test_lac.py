"""Paper 10 (LAC) toy: the ordered-pair task, the binding reward by hand, the bag labels, the
closed-form Gaussian KL by hand, and the planner policy on the task through the trainer."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from helpers import rollout_from

from groupwise.modalities.gauss import gauss_kl
from groupwise.types import StepInfo

binding = importlib.import_module("groupwise.papers.10_lac_latent_flow_grpo.binding")
INFO = StepInfo(step=0, seed=0, max_new_tokens=0)


def test_pairs_bags_and_rows():
    assert len(binding.PAIRS) == 12 and binding.PAIRS[0] == (0, 1) and binding.PAIRS[3] == (1, 0)
    bag = binding.bag_labels()
    # (0, 1) and (1, 0) share the bag of label 0; (2, 3) = label 8 and (3, 2) = label 11 that of label 8
    assert bag[0] == bag[3] == 0 and bag[8] == bag[11] == 8 and len(set(bag)) == 6
    rows = binding.binding_rows(5, seed=1)
    for row in rows:
        i, j = binding.PAIRS[row["prompt"]]
        assert row["pair"] == [i, j]
        mu = binding.mode_centres()
        assert float(torch.tensor(row["target"][:2]).double().sub(mu[i]).norm()) < 0.5
        assert float(torch.tensor(row["target"][2:]).double().sub(mu[j]).norm()) < 0.5
    assert binding.binding_rows(5, seed=1) == rows


def test_binding_score_by_hand():
    # modes on the ring of radius 2: μ_0 = (2, 0), μ_1 = (0, 2); label 0 is the pair (0, 1)
    labels = torch.tensor([0, 0, 0, 0])
    x = torch.tensor(
        [
            [2.0, 0.0, 0.0, 2.0],  # bound: p1 at μ_0, p2 at μ_1 -> 1
            [0.0, 2.0, 2.0, 0.0],  # swapped -> `swapped`
            [2.0, 0.7, 0.0, 2.0],  # p1 0.7 from μ_0 (< 0.75) -> 1
            [2.0, 0.8, 0.0, 2.0],  # p1 0.8 from μ_0 -> 0
        ]
    )
    assert binding.binding_score(x, labels).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert binding.binding_score(x, labels, swapped=0.5).tolist() == [1.0, 0.5, 1.0, 0.0]


def test_gauss_kl_by_hand():
    # 1-D: μ_q = 0.5, σ_q = 0.5, μ_p = 0.2, σ_p = 1:
    # log(1/0.5) + (0.25 + 0.09)/2 − 0.5 = 0.693147 + 0.17 − 0.5 = 0.363147
    got = gauss_kl(torch.tensor([0.5], dtype=torch.float64), 0.5, torch.tensor([0.2], dtype=torch.float64), 1.0)
    assert math.isclose(float(got), 0.363147, abs_tol=1e-6)
    # equal Gaussians: 0; over 2 dims the per-dim terms add: (0.363147 + 0) for μ_q = (0.5, 0.2)
    mu = torch.tensor([[0.5, 0.2]], dtype=torch.float64)
    same = gauss_kl(mu, 0.5, mu, 0.5)
    assert float(same) == 0.0
    two = gauss_kl(mu, 0.5, torch.tensor([[0.2, 0.2]], dtype=torch.float64), 1.0)
    # the second dim: log 2 + 0.25/2 − 0.5 = 0.318147
    assert math.isclose(float(two), 0.363147 + 0.318147, abs_tol=1e-6)


def test_binding_reward_reads_each_rows_label_and_refuses_2d():
    reward = binding.BindingReward()
    x = torch.tensor([[[2.0, 0.0, 0.0, 2.0], [0.0, 2.0, 2.0, 0.0]]])  # [1,2,4]
    roll = rollout_from(torch.zeros(1, 2, 1), prompt_ids=[[0]])  # label 0: the pair (0, 1)
    roll.set_extra("x_final", x, "row")
    assert reward.score_rollout(roll, INFO).tolist() == [[1.0, 0.0]]
    roll.set_extra("x_final", x[..., :2], "row")
    with pytest.raises(ValueError, match=r"x_final' \[B,G,4\]"):
        reward.score_rollout(roll, INFO)
    with pytest.raises(ValueError, match="swapped"):
        binding.BindingReward(swapped=1.0)


def test_the_planner_trains_on_flow_binding(tmp_path):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    bag = str(binding.bag_labels()).replace(" ", "")
    cfg, _ = load_config(
        None,
        [
            f'out="{tmp_path}"',
            'model.policy="planner"',
            'model.params={n_labels=12, dim=4, steps=3, sde="all", hidden=16, layers=2, '
            f'generator_sees="bag", bag={bag}}}',
            'data.task="flow_binding"',
            "rollout.group_size=4",
            "rollout.prompts_per_step=4",
            "eval.size=0",
            "threads=1",
            "train.steps=2",
        ],
    )
    trainer = Trainer(build(cfg))
    rows = [trainer.run_step() for _ in range(2)]
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_lac_align_teaches_binding_through_the_plan():
    from types import SimpleNamespace

    from groupwise.modalities.planner import PlannerPolicy
    from groupwise.phases import lac_align as lac

    policy = PlannerPolicy(
        n_labels=12, dim=4, hidden=32, layers=3, steps=10, generator_sees="bag", bag=binding.bag_labels()
    )
    before = binding.greedy_binding(policy)
    lines = []
    ctx = SimpleNamespace(policy=policy, train_rows=binding.binding_rows(1024, 0), seed=0, say=lines.append)
    out = lac.LacAlign(steps=400)(ctx)
    after = binding.greedy_binding(policy)
    # measured (seed 0): binding 0.0 -> 1.0 on the 12 ordered pairs; the generator sees only the bag, so
    # the order can come only from the plan; the donor's plan makes it draw the donor's order
    assert before["binding_acc"] == 0.0 and after["binding_acc"] == 1.0
    assert after["donor_follow"] >= 0.9
    assert out["summary"]["kl"] < 0.05 and lines and "lac_align" in lines[0]


def test_lac_align_refuses_another_policy():
    from types import SimpleNamespace

    from groupwise.errors import ConfigError
    from groupwise.modalities.planner import PlannerPolicy
    from groupwise.phases import lac_align as lac

    ctx = SimpleNamespace(policy=PlannerPolicy(n_labels=12, dim=2), train_rows=[], seed=0, say=print)
    with pytest.raises(ConfigError, match="dim = 4"):
        lac.LacAlign(steps=1)(ctx)
    with pytest.raises(ConfigError, match="kl_coef"):
        lac.LacAlign(kl_coef=-1.0)


def test_lac_binding_strategy_logs_binding_and_donor_follow_before_and_after(tmp_path):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.run import Run
    from groupwise.trainer import Trainer

    bag = str(binding.bag_labels()).replace(" ", "")
    cfg, _ = load_config(
        None,
        [
            f'out="{tmp_path}"',
            'model.policy="planner"',
            'model.params={n_labels=12, dim=4, steps=10, sde="all", hidden=32, layers=3, '
            f'generator_sees="bag", bag={bag}}}',
            'data.task="flow_binding"',
            'rollout.name="lac_binding"',
            'phases=[{name="lac_align", steps=400}]',
            "rollout.group_size=4",
            "rollout.prompts_per_step=4",
            "eval.size=12",
            "threads=1",
            "train.steps=1",
        ],
    )
    summary = Run(Trainer(build(cfg))).train()
    # the phase runs before the "before" evaluation: the aligned policy binds every pair (test above)
    assert summary["binding_acc_before"] == 1.0 and summary["donor_follow_before"] >= 0.9
    assert 0.0 <= summary["binding_acc_after"] <= 1.0


def test_the_recipe_bag_is_the_tasks():
    from groupwise.config import load_config

    cfg, _ = load_config("lac", ['out="/tmp/unused"'])
    assert cfg.model.params["bag"] == binding.bag_labels() and cfg.model.params["generator_sees"] == "bag"
