"""Declared extras instead of a modality string (issue 41 item 16, design M2 "capabilities"): each
policy kind declares the extras its ``generate`` writes (``row_extras`` / ``token_extras``), a
component the extras it reads (``reads_extras``), and the build refuses a run only when a read extra
is not written. A flow reward now builds on the planner kind (it writes ``x_final``); a weight reading
the masked-diffusion LM's extras fails at build naming them; a kind-only component still matches
``modality``."""

from __future__ import annotations

import importlib

import pytest
import torch

from groupwise.build import build as build_parts
from groupwise.config import load_config
from groupwise.errors import ConfigError
from groupwise.modalities.ar_flow import ARFlowPolicy
from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.flow_toy import FlowRegionReward
from groupwise.modalities.gaussian import GaussianPolicy
from groupwise.modalities.mdlm import MDLMPolicy
from groupwise.modalities.planner import PlannerPolicy
from groupwise.modalities.subset import SubsetPolicy
from groupwise.modalities.unified import UnifiedPolicy
from groupwise.trainer import Trainer
from groupwise.types import Request, StepInfo

INFO = StepInfo(step=1, seed=5, max_new_tokens=0)
SMALL = dict(hidden=8, layers=2, steps=3)
SUBSET_PROMPT = [4, 2, 0.5, *[0.1 * i for i in range(8)], 0.3, -0.2]  # n = 4 items of d = 2, ρ = 0.5, a query

traj2d = importlib.import_module("groupwise.papers.21_kvpo.traj2d")  # a paper folder: digits lead its name
AR_PROMPT = traj2d.traj_rows(1, 0)[0]["prompt"]  # the first frames and the target of one trajectory

POLICIES = {  # name: (policy, one request's prompt)
    "flow label": (FlowPolicy(**SMALL), [1]),
    "flow vector": (FlowPolicy(**SMALL, condition="vector", obs_dim=3), [0.1, 0.2, 0.3]),
    "flow codes": (FlowPolicy(**SMALL, condition_extras={"intent": 2}), [1]),
    "planner latent": (PlannerPolicy(**SMALL), [1]),
    "planner think_lm": (PlannerPolicy(**SMALL, planner="think_lm"), [1]),
    "unified": (UnifiedPolicy(**SMALL), [1]),
    "gaussian": (GaussianPolicy(), [0.5, -1.0]),
    "subset": (SubsetPolicy(d=2, hidden=8), SUBSET_PROMPT),
    "mdlm": (MDLMPolicy(allowed="0123456789+", width=32, heads=2), "7="),
    "ar_flow": (ARFlowPolicy(hidden=8, layers=2), AR_PROMPT),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_policy_declares_exactly_the_extras_it_writes(name):
    policy, prompt = POLICIES[name]
    prompt = policy.encode(prompt) if name == "mdlm" else prompt
    out = policy.generate([Request(key=0, n=2, prompt=prompt)], {}, INFO)
    levels = out.extra_levels
    assert {k for k in out.extras if levels[k] == "row"} == policy.row_extras
    assert {k for k in out.extras if levels[k] == "token"} == policy.token_extras


def test_the_think_and_latent_planners_write_their_own_plan_extra():
    assert POLICIES["planner latent"][0].row_extras == {"x_final", "plan"}
    assert POLICIES["planner think_lm"][0].row_extras == {"x_final", "think_ids"}
    assert "part" in POLICIES["planner think_lm"][0].token_extras
    assert "image_token" in POLICIES["unified"][0].token_extras  # the unified name keeps its extra


PLANNER_ON_FLOW2D = [
    'model.policy="planner"',
    'model.params={n_labels=4, steps=3, sde="all", hidden=16, layers=2, n_plan=2, plan_dim=2, plan_hidden=8}',
    'data.task="flow2d"',
    'rewards=[{name="flow_region", n_labels=4}]',
    "rollout.group_size=4",
    "rollout.prompts_per_step=2",
    "eval.size=0",
    "threads=1",
    'objective.terms=["ppo_clip"]',
]


def test_a_flow_reward_builds_and_scores_on_the_planner_kind(tmp_path):
    # flow_region declared modality "flow" and was refused on the planner kind; it reads x_final, which
    # the planner writes, so it builds now and scores the planner's samples
    cfg, _ = load_config(None, [*PLANNER_ON_FLOW2D, f'out="{tmp_path}"', "train.steps=1"])
    trainer = Trainer(build_parts(cfg))
    batch = trainer.collect()
    labels = [int(p[0]) for p in batch.prompt_ids]  # [B] one label per group
    x = torch.zeros_like(batch.extras["x_final"])  # [B,G,2]
    # label k's centre is 2·(cos 2πk/4, sin 2πk/4): row 0 on it (inside radius 0.75), row 1 at 0.7 off, row 2 at 0.8
    for b, k in enumerate(labels):
        centre = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])[k] * 2  # [2]
        x[b, 0], x[b, 1], x[b, 2] = centre, centre + torch.tensor([0.7, 0.0]), centre + torch.tensor([0.0, 0.8])
        x[b, 3] = -centre  # the opposite side: 4 from the centre
    batch.extras["x_final"] = x
    got = FlowRegionReward(n_labels=4).score_rollout(batch, INFO)  # [B,G]
    assert got.tolist() == [[1.0, 1.0, 0.0, 0.0]] * len(labels)
    assert trainer.run_step()["reward/flow_region"] >= 0.0


def test_a_component_reading_an_extra_the_planner_lacks_fails_at_build_naming_it(tmp_path):
    cfg, _ = load_config(None, [*PLANNER_ON_FLOW2D, f'out="{tmp_path}"', 'objective.weights=["ht_hierarchy"]'])
    with pytest.raises(ConfigError) as err:
        build_parts(cfg)
    message = str(err.value)
    assert "weight component 'ht_hierarchy' reads the rollout extras ['commit_step', 'q_trace']" in message
    assert "the planner policy (model.policy='planner') does not write" in message
    assert "choose a model.policy whose kind writes them, or drop 'ht_hierarchy'" in message


def test_a_kind_only_component_still_matches_the_modality(tmp_path):
    # flash_rectification's 1/c(t) is undefined at the planner's plan positions (σ = 0): it keeps modality "flow"
    cfg, _ = load_config(None, [*PLANNER_ON_FLOW2D, f'out="{tmp_path}"', 'objective.weights=["flash_rectification"]'])
    with pytest.raises(ConfigError, match="'flash_rectification' works on flow policies; this run's policy is planner"):
        build_parts(cfg)


def test_the_label_reward_refuses_an_observation_prompt_when_scoring():
    # any x_final writer passes the build; a policy conditioned on observations fails when flow_region reads labels
    policy = FlowPolicy(**SMALL, condition="vector", obs_dim=1)
    batch = policy.generate([Request(key=0, n=2, prompt=[0.5])], {}, INFO)
    with pytest.raises(ValueError, match=r"flow_region reads each row's label, a prompt \[label\]; got \[0.5\]"):
        FlowRegionReward().score_rollout(batch, INFO)
