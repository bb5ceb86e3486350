"""DEVIS-GRPO (spec 11): the toy views ``cloud_views`` (``papers/11_devis_grpo/cloud_views.py``), the ADEVIS
chains ``adevis`` (``rollout/adevis.py``, joined by ``Rollout.cat_tokens``) and the recipe ``devis`` — the
spec's unit tests worked by hand, the chains' layout and re-scoring, a trainer run and kill-and-resume."""

from __future__ import annotations

import importlib
import json
import math
import random

import pytest
import torch
from helpers import assert_nets_close, assert_resume_is_exact, train_one_and_two_ranks

from groupwise.advantages.grpo import GRPOAdvantage
from groupwise.build import build
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.rollout.adevis import Adevis, drop_below, split_trajectory
from groupwise.run import Run
from groupwise.trainer import Trainer
from groupwise.types import Rollout, StepInfo

views = importlib.import_module("groupwise.papers.11_devis_grpo.cloud_views")
FAST = [
    'phases=[{name="sft", task="cloud_views_fit", steps=5, batch_size=32}]',
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "eval.size=2",
    "threads=1",
]


def test_the_specs_splits():
    assert split_trajectory(90.0, 3, "uniform") == [30.0, 30.0, 30.0]
    rng = random.Random(5)
    for n in (3, 4, 5, 6):  # 3·45 = 135 ≥ 120: a split exists
        deltas = split_trajectory(120.0, n, "dirichlet", rng, alpha=4.0, max_step=45.0)
        assert len(deltas) == n and abs(sum(deltas) - 120.0) < 1e-6 and max(abs(d) for d in deltas) <= 45.0
    # 120 in 2 steps of at most 45 cannot exist (2·45 = 90 < 120): refused, naming the bound
    with pytest.raises(ValueError, match="at most 45"):
        split_trajectory(120.0, 2, "dirichlet", rng, max_step=45.0)
    # 120/4 = 30 is exactly the bound: only the uniform split fits, and it is accepted
    assert split_trajectory(120.0, 4, "uniform", max_step=30.0) == [30.0] * 4


def test_chamfer_and_the_reward_by_hand():
    q = torch.tensor([0.0, 0, 10, 0, 20, 0, 0, 10, 10, 10, 20, 10], dtype=torch.float64)  # six far-apart points
    # identical clouds: Chamfer 0, no outlier → reward 0 (the maximum)
    assert float(views.chamfer(q, q)) == 0.0 and float(views.outlier_fraction(q, q, 0.5)) == 0.0
    # move the first point by (3, 4): its nearest reference point is its own at 5 ((10,0) is √65 = 8.06 away),
    # and (0,0)'s nearest generated point is it at 5; every other pair is 0 → both means 5/6, Chamfer
    # ½(5/6 + 5/6) = 0.833333; one point of six is > 0.5 from all → outliers 1/6;
    # reward −0.833333 − 0.5·(1/6) = −0.916667
    p = q.clone()
    p[:2] += torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert float(views.chamfer(p, q)) == pytest.approx(5 / 6, abs=1e-12)
    assert float(views.outlier_fraction(p, q, 0.5)) == pytest.approx(1 / 6, abs=1e-12)
    # the reward's reference is the observation's cloud rotated by Θ = 90°: (x, y) → (−y, x)
    obs = torch.cat([q, torch.tensor([0.0, 1.0], dtype=torch.float64)])  # [14] cos 90° = 0, sin 90° = 1
    turned = views.rotate(q, math.pi / 2)
    assert turned[2:4].tolist() == pytest.approx([0.0, 10.0], abs=1e-12)  # (10, 0) → (0, 10)
    assert float(views.view_reward(turned, obs)) == pytest.approx(0.0, abs=1e-12)
    moved = views.rotate(p, math.pi / 2)  # the same (3,4) error, rotated: same distances
    assert float(views.view_reward(moved, obs)) == pytest.approx(-5 / 6 - 0.5 / 6, abs=1e-12)


def test_the_tasks_rows():
    fit = views.cloud_rows(50, seed=0, max_deg=30.0)
    rl = views.cloud_rows(3, seed=0, max_deg=None)
    assert all(len(r["prompt"]) == 14 and len(r["target"]) == 12 for r in fit + rl)
    # the fit's Δ stays within ±30°; the RL rows ask for 120° and their target is the exact view
    assert max(abs(math.degrees(math.atan2(r["prompt"][13], r["prompt"][12]))) for r in fit) <= 30.0 + 1e-4
    r = rl[0]
    assert math.degrees(math.atan2(r["prompt"][13], r["prompt"][12])) == pytest.approx(120.0, abs=1e-4)
    exact = views.rotate(torch.tensor(r["prompt"][:12]), math.radians(120.0))
    assert exact.tolist() == pytest.approx(r["target"], abs=1e-5)


def test_strategy_options_are_checked():
    with pytest.raises(ConfigError, match="split"):
        Adevis(split="random")
    with pytest.raises(ConfigError, match="lengths"):
        Adevis(lengths=[0, 2])


@pytest.mark.parametrize("train_steps", ["all", "last"])
def test_chains_are_joined_along_t_and_rescored_under_each_links_condition(tmp_path, train_steps):
    cfg, _ = load_config("devis", [f'out="{tmp_path}"', *FAST, f'rollout.params={{train_steps="{train_steps}"}}'])
    trainer = Trainer(build(cfg))
    batch = trainer.collect()  # [2,4,T]: 8 chains of 4..6 links, one trained SDE step per link (one_shared)
    links = batch.mask.sum(-1)  # [B,G]
    cond = batch.extras["flow_cond"]  # [B,G,T,14] what each trained step was conditioned on
    for b in range(2):
        for g in range(4):
            n = int(links[b, g])
            if train_steps == "last":
                assert n == 1
                continue
            assert n in (4, 5, 6)
            assert batch.segment_id[b, g, :n].tolist() == list(range(6 - n, 6))  # link rounds, right-aligned
            # the links' increments, read back from their conditions, sum to Θ = 120°, each within 40°
            deltas = torch.atan2(cond[b, g, :n, 13].double(), cond[b, g, :n, 12].double())  # [n]
            assert math.degrees(float(deltas.sum())) == pytest.approx(120.0, abs=1e-3)
            assert math.degrees(float(deltas.abs().max())) <= 40.0 + 1e-3
            # link 1 reads the input cloud (the row's prompt), later links the previous link's output
            assert cond[b, g, 0, :12].tolist() == pytest.approx(batch.prompt_ids[b][:12], abs=1e-6)
    # every stored step is re-scored exactly (ratio 1 at the first update) under its own link's condition
    logp = trainer.policy.forward(batch)["logp"]  # [B,G,T]
    torch.testing.assert_close(logp * batch.mask, batch.logp_sampler * batch.mask, atol=1e-6, rtol=0)
    assert torch.isfinite(batch.rewards).all() and (batch.rewards <= 0).all()  # −Chamfer − λ·outliers ≤ 0


def test_min_reward_drops_rows_below_it_from_the_group_by_hand():
    # rewards [−0.2, −0.9, −0.5, −1.2], min_reward −0.6: rows 1 and 3 dropped; the kept [−0.2, −0.5] have
    # mean −0.35 and unbiased std √(2·0.15²/1) = 0.212132 → A = ±0.15/(0.212132 + 1e-4) = ±0.706773; dropped 0
    batch = Rollout(
        prompt_ids=[[0.0]],
        actions=torch.zeros(1, 4, 1, dtype=torch.long),
        mask=torch.ones(1, 4, 1, dtype=torch.bool),
        group_valid=torch.ones(1, 4, dtype=torch.bool),
        truncated=torch.zeros(1, 4, dtype=torch.bool),
        prompt_index=torch.zeros(1, dtype=torch.long),
    )
    batch.rewards = torch.tensor([[-0.2, -0.9, -0.5, -1.2]])
    kept = drop_below(batch, -0.6)
    assert kept.group_valid.tolist() == [[True, False, True, False]]
    assert not kept.row_mask[0, 1].any() and kept.row_mask[0, 0].all()  # a dropped row has no loss token
    adv = GRPOAdvantage()(kept, StepInfo(step=0, seed=0, max_new_tokens=0))  # [1,4]
    assert adv[0].tolist() == pytest.approx([0.706773, 0.0, -0.706773, 0.0], abs=1e-6)
    # a reward equal to the threshold is kept (only "below" drops)
    assert drop_below(batch, -0.5).group_valid.tolist() == [[True, False, True, False]]


def test_min_reward_in_the_recipe_drops_the_low_chains(tmp_path):
    def collect(extra):
        cfg, _ = load_config("devis", [f'out="{tmp_path / str(len(extra))}"', *FAST, *extra])
        return Trainer(build(cfg)).collect()  # [2,4,T]

    every = collect([])
    assert every.group_valid.all()  # off by default: every chain kept
    cut = float(every.rewards.median())
    dropped = collect([f"rollout.params={{min_reward={cut!r}}}"])
    torch.testing.assert_close(dropped.rewards, every.rewards)  # the same seeded chains
    assert torch.equal(dropped.group_valid, every.rewards >= cut) and not dropped.group_valid.all()


def test_the_recipe_trains_and_evaluates_the_chain(tmp_path):
    Run(Trainer(build(load_config("devis", [f'out="{tmp_path}"', *FAST, "train.steps=2"])[0]))).train()
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("chain_reward", "single_shot"):
        assert summary[f"{key}_before"] <= 0 and math.isfinite(summary[f"{key}_after"]), key
    assert summary["steps"] == 2 and summary["skipped_updates"] == 0


def test_a_devis_run_resumes_exactly(tmp_path):
    def trainer(out):
        return Trainer(build(load_config("devis", [f'out="{out}"', *FAST, "train.steps=4", "checkpoint.every=2"])[0]))

    assert_resume_is_exact(trainer, tmp_path)


@pytest.mark.slow  # a torchrun pair: make test-slow / test-dist; make test stays under 10 minutes
@pytest.mark.dist
def test_two_ranks_equal_one_process(tmp_path):
    """One ADEVIS GRPO step (SGD, lr 1) over 2 ranks equals one process: the same weights after it. Each
    row's split is seeded by (seed, step, prompt key, g) and each link by its request, so the two ranks'
    chains are the one process's chains, shared out by prompt."""
    args = ["train", "devis", *FAST, "rollout.prompts_per_step=4", "train.steps=1", "eval.size=0"]
    args += ['update={name="sgd", lr=1.0}']
    one, two = (state["net"] for state in train_one_and_two_ranks(args, tmp_path, "flow_policy.pt", 300))
    start = torch.load(tmp_path / "one" / "phases" / "sft.pt", weights_only=False)["policy"]["net"]  # the fit
    assert any(not torch.equal(one[k], start[k]) for k in start)  # the GRPO step moved the fitted net
    assert_nets_close(one, two)
