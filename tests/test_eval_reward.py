"""M4 of the non-text design (issue 37): held-out evaluation logs the mean eval reward and every
eval reward metric (not only the "reward ≥ 1" accuracy), and ``eval.sampling`` deploys the policy
with other sampling settings than it trained on (the flow toy with the consistency sampler)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from groupwise.build import build
from groupwise.claims.compare import read_run
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.heldout import HeldOut
from groupwise.rollout.sample import Sample
from groupwise.run import Run
from groupwise.trainer import Trainer
from groupwise.types import Request


def _trainer(out, *overrides):
    cfg, _ = load_config("flash_grpo", [f'out="{out}"', *overrides])
    return Trainer(build(cfg))


def test_evaluate_detail_gives_the_mean_reward_beside_the_accuracy(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "eval.size=4")
    heldout = HeldOut(trainer)
    rewards = iter([torch.tensor([[1.0], [0.5], [float("nan")], [0.0]])])

    def finish(gen, info):  # the eval stage's totals replaced by known rewards
        gen.rewards = next(rewards)

    monkeypatch.setattr(heldout.eval_stage, "finish", finish)
    full = heldout.evaluate_detail()
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
        heldout.evaluate_detail()
    assert "sampler" not in seen[0] and seen[1]["sampler"] == "consistency" and seen[1]["steps"] == 4
    assert seen[1]["greedy"] is True
    with pytest.raises(ConfigError, match=r"eval.sampling sets \['temperature'\], which the flow policy does not take"):
        _trainer(tmp_path / "c", "eval.sampling={temperature=0.5}")


@dataclass
class _BestOfTwo(Sample):
    """The default strategy, with its own held-out evaluation: the best of 2 samples per held-out row."""

    def evaluate(self, ctx, rows, info):
        scored = ctx.rollout([Request(key=i, n=2) for i in range(len(rows))])  # [B,2] rewards
        return {"best_of_2": float(scored.rewards.max(1).values.mean()), "rows": float(len(rows))}


def test_a_strategys_own_evaluation_is_logged(tmp_path, monkeypatch):
    from groupwise import registry

    registry.load_all()
    monkeypatch.setitem(registry._REGISTRY["rollout"], "test_best_of_two", _BestOfTwo)
    trainer = _trainer(tmp_path, "train.steps=2", "eval.size=8", "eval.every=1", 'rollout.name="test_best_of_two"')
    seen = []
    original = trainer.policy.generate

    def spy(requests, sampling, info):
        seen.append((len(requests), sampling.get("greedy"), info.step))
        return original(requests, sampling, info)

    trainer.policy.generate = spy
    summary = Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["eval/rows"] == 8.0 and 0.0 <= r["eval/best_of_2"] <= 1.0 for r in rows)
    assert summary["rows_after"] == 8.0 and "best_of_2_before" in summary
    # its calls: 8 held-out requests of 2 rows, greedy (the flow toy's deterministic sampler), step -1's noise
    assert (8, True, -1) in seen
