"""AlphaGRPO's image half on the 2-D flow toy (spec 27): the ``point2d`` decomposer's questions and
margins, DVReward over flow samples by hand (the same text scorer as the number toy), the
``flow_attrs`` task, and two training steps of the flow policy on it with ppo_clip and gspo."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import paper_module

from groupwise.advantages.alphagrpo import per_prompt_advantages
from groupwise.build import build as build_parts
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rewards._common import RewardError
from groupwise.rewards.dv_questions import DOMAINS, as_point
from groupwise.rewards.dvreward import decompose, dv_reward
from groupwise.tasks import get_task
from groupwise.trainer import Trainer

_flow_attrs = paper_module("27_alphagrpo", "flow_attrs")
N_LABELS, label_attrs = _flow_attrs.N_LABELS, _flow_attrs.label_attrs


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_point_parser():
    assert as_point("0.5000,-1.2500") == (0.5, -1.25) and as_point(" 1,2 ") == (1.0, 2.0)
    for bad in ("", "1", "1,2,3", "a,b", "nan,1", "inf,0"):
        assert as_point(bad) is None


def test_point2d_questions_and_margins_by_hand():
    sem, qual = decompose("1.0000,-0.5000", ["right", "lower", "near"], "point2d")
    assert [q for q, _ in sem] == [
        "Is the point (1.0000,-0.5000) right of the vertical axis?",
        "Is the point (1.0000,-0.5000) below the horizontal axis?",
        "Is the point (1.0000,-0.5000) within distance 1 of the centre?",
    ]
    assert [m for _, m in sem] == [
        1.0,
        0.5,
        pytest.approx(1 - math.sqrt(1.25), abs=1e-12),
    ]  # r = 1.1180: just outside "near"
    assert [q for q, _ in qual] == [
        "Is (1.0000,-0.5000) a finite 2-D point?",
        "Is the point (1.0000,-0.5000) inside the canvas?",
    ]
    assert [m for _, m in qual] == [1.0, 2.0]  # canvas: 3 − max(|1|, |−0.5|)
    sem, _ = decompose("0.0000,1.5000", ["left", "upper", "mid", "far"], "point2d")
    assert [m for _, m in sem] == [-0.0, 1.5, pytest.approx(0.5), pytest.approx(-0.5)]
    sem, qual = decompose("3.5000,0.0000", ["far"], "point2d")
    assert sem[0][1] == pytest.approx(1.5) and qual[1][1] == pytest.approx(-0.5)  # far, but off the canvas
    sem, qual = decompose("x,y", ["right"], "point2d")
    assert [m for _, m in sem + qual] == [-1.0, -1.0, -1.0]  # no point: every answer no
    with pytest.raises(RewardError, match="point2d"):
        decompose("1,1", ["even"], "point2d")


def test_dv_reward_on_flow_samples_by_hand():
    reward = build("reward", "dv_reward", domain="point2d")
    metrics = {}
    got = reward(
        [0, 11],
        ["1.0000,-0.5000", "-1.0000,1.0000"],
        attrs=["right,lower,near", "right,lower,far"],
        log_metric=lambda k, v: metrics.__setitem__(k, v),
    )
    # row 0: SC = mean(σ(4·1), σ(4·0.5), σ(4·(1 − √1.25))), PQ = mean(σ(4), σ(8))
    sc0 = (sig(4.0) + sig(2.0) + sig(4 * (1 - math.sqrt(1.25)))) / 3
    pq0 = (sig(4.0) + sig(8.0)) / 2
    # row 1 (−1, 1) for right,lower,far: margins −1, −1, √2 − 2; quality 1, 2
    sc1 = (sig(-4.0) + sig(-4.0) + sig(4 * (math.sqrt(2) - 2))) / 3
    pq1 = (sig(4.0) + sig(8.0)) / 2
    assert got == [pytest.approx(math.sqrt(sc0 * pq0), abs=1e-12), pytest.approx(math.sqrt(sc1 * pq1), abs=1e-12)]
    assert metrics["dv_sat"] == pytest.approx((2 / 3 + 0) / 2) and metrics["dv_sc"] == pytest.approx((sc0 + sc1) / 2)
    holistic = build("reward", "dv_reward", domain="point2d", method="holistic")
    assert holistic([0, 0], ["1.0000,-0.5000", "0.5000,-0.5000"], attrs=["right,lower,near"] * 2) == [0.0, 1.0]
    # the same component: the number domain is the default, and a flow sample is no number
    assert build("reward", "dv_reward")([0], ["0.5000,-0.5000"], attrs=["even"])[0] == pytest.approx(sig(-4.0))
    with pytest.raises(ConfigError, match="domain"):
        build("reward", "dv_reward", domain="image")
    assert set(DOMAINS) == {"number", "point2d"}


def test_flow_attrs_task():
    assert (
        N_LABELS == 12
        and label_attrs(0) == "right,upper,near"
        and label_attrs(4) == "left,upper,mid"
        and label_attrs(11) == "right,lower,far"
    )
    task = get_task("flow_attrs")
    train, test = task.rows("train", 0, 0), task.rows("test", 0, 0)
    assert len(train) == 256 and len(test) == 64 and train != test
    assert all(r["attrs"] == label_attrs(r["prompt"]) for r in train + test) and {r["prompt"] for r in train} == set(
        range(12)
    )
    assert task.reward == {"name": "dv_reward", "domain": "point2d", "method": "holistic"}


FLOW = [
    'model.policy="flow"',
    'model.params={n_labels=12, steps=4, sde="one_shared", hidden=16}',
    'data.task="flow_attrs"',
    'rewards=[{name="dv_reward", domain="point2d"}]',
    'advantage.estimator="alphagrpo"',
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "eval.size=8",
    "threads=1",
    'update={name="adamw", lr=5e-3}',
]


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_flow_steps_score_the_samples_with_dvreward(tmp_path, objective):
    cfg, _ = load_config(
        None,
        [*FLOW, f'out="{tmp_path}"', f'objective.terms=["{objective}", {{name="kl", coef=0.04}}]', "train.steps=2"],
    )
    trainer = Trainer(build_parts(cfg))
    seen, rows = [], []
    prepare = trainer.prepare
    trainer.prepare = lambda batch: (seen.append(prepare(batch)), seen[-1])[1]
    for _ in range(2):
        rows.append(trainer.run_step())
    for batch, row in zip(seen, rows):
        x = batch.extras["x_final"]  # [B,G,2]
        sat = []
        for b, meta in enumerate(batch.meta):
            keys = meta["attrs"].split(",")
            assert meta["attrs"] == label_attrs(batch.prompt_ids[b][0])
            for g in range(batch.shape[1]):
                text = f"{float(x[b, g, 0]):.4f},{float(x[b, g, 1]):.4f}"  # the sample as the policy decodes it
                sem, qual = decompose(text, keys, "point2d")
                want = dv_reward([sig(4 * m) for _, m in sem], [sig(4 * m) for _, m in qual])
                assert float(batch.rewards[b, g]) == pytest.approx(want, abs=1e-6)
                sat.append(sum(m > 0 for _, m in sem) / len(sem))
        assert row["reward_metric/dv_sat"] == pytest.approx(sum(sat) / len(sat))
        ids = [int(i) for i in batch.prompt_index for _ in range(batch.shape[1])]
        want = per_prompt_advantages(batch.rewards.reshape(-1), ids, valid=batch.group_valid.reshape(-1)).reshape(
            batch.shape[:2]
        )
        torch.testing.assert_close(batch.advantages, want.float())
        assert math.isfinite(row["loss"])
