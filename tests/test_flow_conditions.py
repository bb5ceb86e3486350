"""M2 of the non-text design (issue 37): a flow row is trained and rewarded under its own context,
the sample dimension is a parameter, a vector observation is an encoded prompt, and request extras
are conditions read while sampling and stored per trained step (``flow_cond``)."""

from __future__ import annotations

import pytest
import torch

from groupwise.modalities.flow import FlowPolicy
from groupwise.modalities.flow_toy import FlowRegionReward, mixture_centres
from groupwise.types import Request, StepInfo

INFO = StepInfo(step=2, seed=11, max_new_tokens=0)


def _recomputed(policy, rollout):
    logp = policy.forward(rollout)["logp"]  # [B,G,T]
    return torch.equal(logp, rollout.logp_sampler)


@pytest.mark.parametrize("sde", ["one_shared", "all"])
def test_a_row_with_its_own_context_is_trained_under_its_own_label(sde):
    # label 1's group gets two rows sampled for label 3 (join_rows keeps their context as ctx): before
    # issue 37 forward read prompt_ids[b][0] = 1 for all four rows, so the recomputed log-probs of
    # the label-3 rows differed from the sampler's (the trained transition under the wrong condition)
    policy = FlowPolicy(sde=sde)
    first = policy.generate([Request(key=0, n=2, prompt=1)], {}, INFO)
    more = policy.generate([Request(key=1, n=2, prompt=3)], {}, INFO)
    joined = first.join_rows(more, [0])
    assert joined.row_contexts() == [[[1], [1], [3], [3]]]
    assert _recomputed(policy, joined)


def test_flow_region_rewards_a_row_on_its_own_label():
    # a point at μ_3 = (0,-2) in label 1's group: rewarded when the row's context is [3], not when it is [1]
    policy = FlowPolicy()
    first = policy.generate([Request(key=0, n=1, prompt=1)], {}, INFO)
    more = policy.generate([Request(key=1, n=1, prompt=3)], {}, INFO)
    joined = first.join_rows(more, [0])
    joined.extras["x_final"] = torch.stack([mixture_centres()[1], mixture_centres()[3]])[None]  # [1,2,2]
    assert FlowRegionReward().score_rollout(joined, INFO).tolist() == [[1.0, 1.0]]
    joined.ctx = [[[1], [1]]]
    assert FlowRegionReward().score_rollout(joined, INFO).tolist() == [[1.0, 0.0]]


def test_the_sample_dimension_is_a_parameter():
    policy = FlowPolicy(dim=3, sde="all")
    out = policy.generate([Request(key=0, n=2, prompt=0), Request(key=5, n=1, prompt=2)], {}, INFO)
    assert out.extras["x_final"].shape == (2, 2, 3) and out.extras["flow_x"].shape == (2, 2, 10, 3)
    assert policy.net.inp.in_features == 3 + 1 + 8 and policy.net.out.out_features == 3
    assert len(out.completions[0][0].split(",")) == 3 and out.completions[1][1] == ""
    assert _recomputed(policy, out)
    assert policy.config["dim"] == 3 and "dim" not in FlowPolicy().config  # 2-D checkpoints stay as they were
    with pytest.raises(ValueError, match=r"flow_region needs the row extra 'x_final' \[B,G,2\] of 2-D samples"):
        FlowRegionReward().score_rollout(out, INFO)


def test_a_vector_observation_is_the_encoded_prompt_and_is_stored_per_step():
    policy = FlowPolicy(condition="vector", obs_dim=3, sde="one_per_row")
    assert policy.encode([0.5, -1, 2]) == [0.5, -1.0, 2.0]
    with pytest.raises(ValueError, match=r"a prompt must be an observation of 3 numbers, got \[1, 2\]"):
        policy.encode([1, 2])
    a = policy.generate([Request(key=0, n=3, prompt=[0.1, 0.2, 0.3])], {}, INFO)
    b = policy.generate([Request(key=0, n=3, prompt=[-2.0, 0.0, 1.0])], {}, INFO)
    # the same seeds (key 0), another observation: other samples
    assert not torch.equal(a.extras["x_final"], b.extras["x_final"])
    cond = a.extras["flow_cond"]  # [1,3,1,3]
    assert cond.shape == (1, 3, 1, 3) and torch.equal(cond[0, 2, 0], torch.tensor([0.1, 0.2, 0.3]))
    assert a.prompt_ids == [[0.1, 0.2, 0.3]] and _recomputed(policy, a)
    # b's rows in a's group (ctx set): each step is scored under the observation it was sampled with
    assert _recomputed(policy, a.join_rows(b, [0]))


def test_request_extras_are_conditions_read_while_sampling():
    policy = FlowPolicy(condition_extras={"intent": 4}, sde="all")
    requests = [
        Request(key=0, n=2, prompt=1, extras={"intent": [0, 3]}),
        Request(key=0, n=2, prompt=1, extras={"intent": [-1, -1]}),
        Request(key=0, n=2, prompt=1),  # no intent: the null condition, as -1
    ]
    out = policy.generate(requests, {}, INFO)
    codes = out.extras["flow_cond"][:, :, 0, 0]  # [3,2] the stored intent of each row's first step
    assert codes.tolist() == [[0.0, 3.0], [-1.0, -1.0], [-1.0, -1.0]]
    x = out.extras["x_final"]  # [3,2,2]: the same seeds per slot, so only the intent differs
    assert not torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])
    assert _recomputed(policy, out)
    with pytest.raises(ValueError, match=r"request 0's condition 'intent' = \[4\] must lie in -1..3"):
        policy.generate([Request(key=0, n=1, prompt=0, extras={"intent": [4]})], {}, INFO)
    with pytest.raises(ValueError, match="need dim >= 1 .*condition_extras as"):
        FlowPolicy(condition_extras={"intent": 0})


def test_a_strategy_that_sets_no_condition_is_refused_at_build(tmp_path):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.errors import ConfigError

    cfg, _ = load_config("flash_grpo", [f'out="{tmp_path}"', "model.params={condition_extras={intent=4}}"])
    with pytest.raises(
        ConfigError, match=r"samples under the request extras \['intent'\] .* strategy 'sample' does not set"
    ):
        build(cfg)
