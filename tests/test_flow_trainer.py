"""The non-text policy through the same trainer (issue 11 item 5): the 2-D flow toy trains with the
shipped ``flash_grpo`` recipe, resumes exactly, and a component made for one modality is refused
at build on another."""

from __future__ import annotations

import json

import pytest
import torch

from groupwise.build import build
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.run import Run
from groupwise.trainer import Trainer


def flow_trainer(out, *overrides):
    cfg, _ = load_config("flash_grpo", [f'out="{out}"', *overrides])
    return Trainer(build(cfg))


def test_the_flow_toy_learns_through_the_trainer(tmp_path):
    trainer = flow_trainer(tmp_path / "run", "train.steps=100", "eval.size=64")
    summary = Run(trainer).train()
    # seed 0, measured: 0.125 -> 1.0 (every held-out label's ODE sample lands in its region)
    assert summary["accuracy_before"] < 0.2 and summary["accuracy_after"] >= 0.9
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["completion_len"] == 1.0  # one trained SDE step per row (Flash-GRPO)
    assert (tmp_path / "run" / "final" / "flow_policy.pt").exists()


def test_a_flow_run_resumes_exactly(tmp_path):
    common = ["train.steps=6", "eval.size=0", "checkpoint.every=3"]
    straight = flow_trainer(tmp_path / "a", *common)
    Run(straight).train()
    first = flow_trainer(tmp_path / "b", *common)
    first.cfg.train.steps = 3
    Run(first).train()
    resumed = flow_trainer(tmp_path / "b", *common)
    Run(resumed).train(resume_allow=["train.steps"])
    for key, value in straight.policy.state_dict()["net"].items():
        assert torch.equal(value, resumed.policy.state_dict()["net"][key]), key
    rows = [
        [json.loads(line)["reward_mean"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("a", "b")
    ]
    assert rows[0] == rows[1]


def test_a_component_of_another_modality_is_refused_at_build(tmp_path):
    with pytest.raises(
        ConfigError, match="weight component 'flash_rectification' works on flow policies; this run's policy is text"
    ):
        cfg, _ = load_config(None, [f'out="{tmp_path}"', 'objective.weights=["flash_rectification"]', "eval.size=0"])
        Trainer(build(cfg))
    with pytest.raises(ConfigError, match="model.policy='video' is not a policy kind; kinds: lm, flow"):
        cfg, _ = load_config("flash_grpo", [f'out="{tmp_path}"', 'model.policy="video"'])
        Trainer(build(cfg))
