"""ReMax (Li et al. 2023): the greedy-baseline rollout strategy and advantage, per-request sampling
overrides in the rollout context, and the build-time checks that tie them together."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, make_rollout
from test_trainer import make_trainer

from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rollout.context import RolloutContext, check_strategy
from groupwise.run import Run
from groupwise.types import Request

NAN = float("nan")


def test_advantage_is_reward_minus_greedy_reward_by_hand():
    ro = make_rollout(3, 3, 4, seed=0)
    ro.rewards = torch.tensor([[1.0, 0.0, 1.0], [0.5, 0.5, NAN], [2.0, 1.0, 0.0]])  # [B,G]
    ro.group_valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    ro.set_extra("baseline_reward", torch.tensor([0.5, 1.0, NAN]), "group")  # group 2: the greedy reward was excluded
    adv = build("advantage", "remax")(ro, info_for(4))
    # group 0: 1 − 0.5, 0 − 0.5, 1 − 0.5; group 1: 0.5 − 1 twice, the NaN reward row 0; group 2: no baseline → 0
    assert adv.tolist() == [[0.5, -0.5, 0.5], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]]
    assert adv.dtype == torch.float32


def test_advantage_without_the_strategys_extra_names_the_fix():
    ro = make_rollout(1, 2, 3, seed=0)
    with pytest.raises(ValueError, match="rollout.name='remax'"):
        build("advantage", "remax")(ro, info_for(3))


def test_an_estimator_reading_baseline_reward_fails_at_build_without_the_remax_strategy(tmp_path):
    with pytest.raises(ConfigError, match="reads 'baseline_reward'.*rollout.name='remax'"):
        make_trainer(tmp_path, 'advantage.estimator="remax"')


def test_a_strategy_asking_for_an_option_the_policy_lacks_fails_at_build():
    class Flowish:
        modality, request_options = "flow", frozenset({"greedy"})

    class WantsTopP:
        request_options, collects = ("top_p",), ()

    with pytest.raises(ConfigError, match=r"sampling options \['top_p'\].*flow policy"):
        check_strategy(WantsTopP(), Flowish(), [])
    check_strategy(build("rollout", "remax"), Flowish(), [build("advantage", "remax")])  # greedy is offered: no error


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


def test_mixed_sampling_overrides_come_back_in_request_order_and_equal_separate_calls(tmp_path):
    trainer = make_trainer(tmp_path, "rollout.group_size=2")
    ctx = _context(trainer)
    mixed = ctx.rollout([Request(3, 2), Request(5, 2, sampling={"greedy": True}), Request(7, 2)])
    sampled = ctx.rollout([Request(3, 2), Request(7, 2)])
    greedy = ctx.rollout([Request(5, 2, sampling={"greedy": True})])
    assert mixed.prompt_index.tolist() == [3, 5, 7]
    T = mixed.shape[2]
    for got, want in ((mixed.select([0, 2]), sampled), (mixed.select([1]), greedy)):
        t = want.shape[2]
        assert torch.equal(got.actions[..., :t][got.mask[..., :t]], want.actions[want.mask])
        assert torch.equal(got.rewards, want.rewards)
    assert T >= max(sampled.shape[2], greedy.shape[2])
    assert torch.equal(greedy.actions[0, 0], greedy.actions[0, 1])  # greedy: both rows decode the same tokens
    with pytest.raises(ValueError, match="not offered by the policy"):
        ctx.rollout([Request(3, 1, sampling={"beam_width": 4})])


def test_remax_trains_on_the_samples_with_the_greedy_reward_as_baseline(tmp_path):
    trainer = make_trainer(
        tmp_path,
        'rollout.name="remax"',
        'advantage.estimator="remax"',
        "rollout.group_size=2",
        "train.steps=1",
        "eval.size=0",
    )
    seen = {}
    prepare = trainer.prepare

    def prepare_and_rescore(batch):  # before the update: the weights that sampled the batch
        seen["greedy"] = _context(trainer).rollout(
            [Request(int(k), 1, sampling={"greedy": True}) for k in batch.prompt_index]
        )
        seen["batch"] = prepare(batch)
        return seen["batch"]

    trainer.prepare = prepare_and_rescore
    Run(trainer).train()
    batch, greedy = seen["batch"], seen["greedy"]
    B = trainer.cfg.rollout.prompts_per_step
    assert batch.shape[:2] == (B, 2)  # the greedy rows are not trained on
    # the baseline is the reward of each prompt's greedy completion, scored independently here
    assert torch.equal(batch.extras["baseline_reward"], greedy.rewards[:, 0])
    want = batch.rewards - batch.extras["baseline_reward"][:, None]  # [B,G]
    assert torch.equal(batch.advantages, want.float())
    assert not math.isnan(float(batch.advantages.abs().sum()))


def test_remax_equals_verls_outcome_advantage_broadcast_over_the_tokens():
    # verl core_algos.compute_remax_outcome_advantage: token_level_rewards hold the outcome at the last
    # response token; returns = reverse cumsum; advantages = returns − baseline · mask. Re-derived here.
    g = torch.Generator().manual_seed(3)
    ro = make_rollout(4, 3, 5, seed=4, awkward=False)
    ro.rewards = torch.rand(4, 3, generator=g) * 2 - 1  # [B,G]
    baseline = torch.rand(4, generator=g)  # [B]
    ro.set_extra("baseline_reward", baseline, "group")
    ours = build("advantage", "remax")(ro, info_for(5))  # [B,G]
    mask = ro.row_mask.float().reshape(12, 5)  # [N,T]
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()  # [N,T] the last response token
    token_rewards = torch.where(last, ro.rewards.reshape(12, 1).expand(12, 5), torch.zeros(()))  # [N,T]
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [N,T]
    verl = returns - baseline.repeat_interleave(3)[:, None] * mask  # [N,T]
    mine = ours.reshape(12, 1) * mask  # [N,T] our row value on each response token
    print(f"verl parity remax: max |diff| = {(verl - mine).abs().max():.2e}")
    torch.testing.assert_close(mine, verl, atol=1e-6, rtol=0)
    assert verl.abs().sum() > 0
