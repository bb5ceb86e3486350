"""M4 of the non-text design (issue 37): held-out evaluation logs the mean eval reward and every
eval reward metric (not only the "reward ≥ 1" accuracy), and ``eval.sampling`` deploys the policy
with other sampling settings than it trained on (the flow toy with the consistency sampler)."""

from __future__ import annotations

import json

import pytest
import torch

from groupwise.build import build
from groupwise.claims.compare import read_run
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.heldout import HeldOut
from groupwise.run import Run
from groupwise.trainer import Trainer


def _trainer(out, *overrides):
    cfg, _ = load_config("flash_grpo", [f'out="{out}"', *overrides])
    return Trainer(build(cfg))


def test_evaluate_full_gives_the_mean_reward_beside_the_accuracy(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "eval.size=4")
    heldout = HeldOut(trainer)
    rewards = iter([torch.tensor([[1.0], [0.5], [float("nan")], [0.0]])])

    def finish(gen, info):  # the eval stage's totals replaced by known rewards
        gen.rewards = next(rewards)

    monkeypatch.setattr(heldout.eval_stage, "finish", finish)
    full = heldout.evaluate_full()
    # accuracy: 1 of 4 rows ≥ 1 (the failed NaN row counts as wrong); the mean over the 3 finite
    # rewards: (1 + 0.5 + 0) / 3 = 0.5
    assert full["accuracy"] == 0.25 and full["reward_mean"] == pytest.approx(0.5)


def test_the_run_logs_the_mean_reward_and_the_reward_metrics(tmp_path):
    cfg, _ = load_config(
        "alphagrpo_flow",
        [f'out="{tmp_path}"', "train.steps=2", "eval.size=8", "eval.every=1", "rollout.prompts_per_step=2"],
    )
    trainer = Trainer(build(cfg))
    summary = Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # dv_reward (point2d) logs dv_sat / dv_pq / dv_sc: each is an eval metric, besides the mean reward
    for key in ("eval_reward_mean", "eval_metric/dv_sat", "eval_metric/dv_pq", "eval_metric/dv_sc"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert 0.0 <= summary["reward_mean_after"] <= 1.0 and "metric_after/dv_sat" in summary
    assert summary["reward_mean_before"] is not None
    # the claims read it as final_reward_mean
    assert read_run(tmp_path, None)["final_reward_mean"] == summary["reward_mean_after"]


def test_eval_sampling_deploys_another_kernel_and_is_checked(tmp_path):
    plain = HeldOut(_trainer(tmp_path / "a", "eval.size=8"))
    deployed = HeldOut(_trainer(tmp_path / "b", "eval.size=8", 'eval.sampling={sampler="consistency", steps=4}'))
    seen = []
    for heldout in (plain, deployed):
        original = heldout.trainer.policy.generate

        def spy(requests, sampling, info, original=original):
            seen.append(dict(sampling))
            return original(requests, sampling, info)

        heldout.trainer.policy.generate = spy
        heldout.evaluate_full()
    assert "sampler" not in seen[0] and seen[1]["sampler"] == "consistency" and seen[1]["steps"] == 4
    assert seen[1]["greedy"] is True
    with pytest.raises(ConfigError, match=r"eval.sampling sets \['temperature'\], which the flow policy does not take"):
        _trainer(tmp_path / "c", "eval.sampling={temperature=0.5}")
