"""VSPO (spec 17): the steering hook adds exactly α·v, the CAA vector by hand, the α grid per row,
the spec's reward/advantage numbers, rows trained unsteered, the row_extra reward, the build refusal
on an engine without hooks, composition with ppo_clip and gspo."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from helpers import info_for, make_rollout, train_recorded
from transformers import AutoModelForCausalLM

from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rollout.vspo import (
    ALPHA,
    COEF,
    VSPO,
    alpha_rows,
    compute_steering_vector,
    residual_at_last,
    steering_hook,
    vspo_rewards,
)


def tiny_model():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return AutoModelForCausalLM.from_config(config).eval()


# --------------------------------------------------------------------------- (1) the hook
def test_steering_with_alpha_zero_is_the_clean_model_exactly():
    model, ids = tiny_model(), torch.tensor([[3, 4, 5, 6]])
    v = torch.randn(32)
    with torch.no_grad():
        clean = model(ids).logits
        with steering_hook(model, 2, v, 0.0):
            zero = model(ids).logits
    assert torch.equal(clean, zero)


def test_the_block_output_changes_by_exactly_alpha_v():
    model, ids = tiny_model(), torch.tensor([[3, 4, 5, 6]])
    v = torch.randn(32)
    seen = {}
    grab = model.model.layers[2].register_forward_pre_hook(
        lambda m, args, kwargs: seen.__setitem__(len(seen), args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True,
    )
    try:
        with torch.no_grad():
            model(ids)
            with steering_hook(model, 2, v, 1.5):  # after decoder layer 2 = the input of layer 3 (index 2)
                model(ids)
    finally:
        grab.remove()
    torch.testing.assert_close(seen[1] - seen[0], (1.5 * v).expand(1, 4, 32), atol=1e-5, rtol=0)
    assert not any(m._forward_hooks for m in model.modules())


def test_caa_vector_is_the_mean_difference_at_the_last_token():
    model = tiny_model()
    pos, neg = [[3, 4, 9], [5, 9]], [[3, 4], [5, 6, 7]]
    with torch.no_grad():
        # after layer 1
        h = [model(torch.tensor([p]), output_hidden_states=True).hidden_states[1][0, -1] for p in pos + neg]
    raw = (h[0] + h[1]) / 2 - (h[2] + h[3]) / 2
    v, stats = compute_steering_vector(model, 1, pos, neg, normalise="none")
    torch.testing.assert_close(v, raw, atol=1e-5, rtol=0)
    typical = sum(float(x.norm()) for x in h) / 4
    v_h, stats = compute_steering_vector(model, 1, pos, neg)  # hidden_norm: unit direction x the typical norm
    torch.testing.assert_close(v_h, raw / raw.norm() * typical, atol=1e-4, rtol=0)
    assert stats["norm"] == pytest.approx(typical, abs=1e-4) and stats["raw_norm"] == pytest.approx(
        float(raw.norm()), abs=1e-5
    )
    v_u, _ = compute_steering_vector(model, 1, pos, neg, normalise="unit")
    assert float(v_u.norm()) == pytest.approx(1.0, abs=1e-6)
    assert residual_at_last(model, 0, [[7]]).shape == (1, 32)  # layer 0: the embeddings
    torch.testing.assert_close(residual_at_last(model, 0, [[7]])[0], model.model.embed_tokens.weight[7].detach())


# --------------------------------------------------------------------------- (2) grid, rewards, advantages
def test_alpha_grid_assignment_per_row():
    grid = [-4.0, -2.0, -1.0, 0.0, 0.0, 1.0, 2.0, 4.0]
    assert alpha_rows(grid, 8).tolist() == grid
    assert alpha_rows(grid, 4).tolist() == [-4.0, -2.0, -1.0, 0.0]
    assert alpha_rows([-1.0, 0.0, 1.0], 7).tolist() == [-1.0, 0.0, 1.0, -1.0, 0.0, 1.0, -1.0]
    strategy = VSPO(alphas=grid)
    strategy.use_artifact("steering_vector", {"vector": torch.ones(4), "layer": 2})
    hook, extras = strategy._request_parts(8)
    assert hook.layer == 2 and hook.alpha.tolist() == grid
    assert extras[ALPHA].tolist() == grid
    assert extras[COEF].tolist() == [-1.0, -0.5, -0.25, 0.0, 0.0, 0.25, 0.5, 1.0]  # α / α_max
    control = VSPO(alphas=[0.0])  # the reward-shaped GRPO control: every row unsteered
    control.use_artifact("steering_vector", {"vector": torch.ones(4), "layer": 2})
    assert control._request_parts(3)[1][COEF].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="non-empty list of finite numbers"):
        VSPO(alphas=[])


def test_reward_combination_and_population_std_advantages_from_the_spec():
    r = vspo_rewards(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), torch.tensor([[0.0, 1.0, 1.0, 0.0]]), lam_b=0.5)
    torch.testing.assert_close(r, torch.tensor([[1.0, 0.5, 1.5, 0.0]]))
    ro = make_rollout(1, 4, 3, seed=0, awkward=False)
    ro.rewards = r
    adv = build("advantage", "grpo", std="population", eps=0.0)(ro, info_for(3))  # [1,4]
    # mean 0.75, population std sqrt(0.3125) = 0.5590
    torch.testing.assert_close(adv, torch.tensor([[0.4472136, -0.4472136, 1.3416408, -1.3416408]]), atol=1e-6, rtol=0)


def test_row_extra_reward_scores_the_rows_label():
    ro = make_rollout(2, 3, 4, seed=1, awkward=False)
    ro.group_valid = torch.tensor([[True, True, False], [True, True, True]])
    ro.set_extra(COEF, torch.tensor([[-1.0, 0.5, 1.0], [0.0, 0.25, -0.5]]), "row")
    reward = build("reward", "row_extra", key=COEF)
    assert reward.rollout_extras == (COEF,)
    torch.testing.assert_close(
        reward.score_rollout(ro, info_for(4)), torch.tensor([[-1.0, 0.5, 0.0], [0.0, 0.25, -0.5]])
    )  # invalid row: 0


def test_row_extra_reward_needs_a_strategy_that_collects_the_extra(tmp_path):
    from test_trainer import make_trainer

    with pytest.raises(ConfigError, match="reads 'steer_coef', which the rollout strategy 'sample' does not collect"):
        make_trainer(tmp_path, 'rewards=["exact", {name="row_extra", key="steer_coef", weight=0.5}]', "eval.size=0")


# --------------------------------------------------------------------------- (3) end to end: the update is unsteered
PHASE = 'phases=[{name="steering_vector", layer=2, rows=4}]'
RUN = [
    'rollout.name="vspo"',
    PHASE,
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "threads=1",
    "rollout.params={alphas=[-1.0, 0.0, 1.0, 0.0]}",
    'rewards=["exact", {name="row_extra", key="steer_coef", weight=0.5}]',
]


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_steered_rows_are_trained_with_the_hook_off(tmp_path, objective):
    rows, seen = train_recorded(tmp_path, objective, *RUN)
    for batch in seen:
        alpha = batch.extras[ALPHA]  # [B,G]
        assert alpha[0].tolist() == [-1.0, 0.0, 1.0, 0.0]
        gap = (batch.logp_old - batch.logp_sampler).abs() * batch.mask  # [B,G,T]
        assert float(gap[alpha == 0].max()) < 1e-4  # unsteered rows: the sampler was the clean model
        assert float(gap[alpha != 0].max()) > 1e-2  # steered rows: logp_old is the clean forward, not the sampler's
        # the total reward is the task plus 0.5 · α/α_max (the row_extra reward), exactly
        task = batch.reward_parts[..., 0]  # [B,G]
        torch.testing.assert_close(batch.rewards, task + 0.5 * batch.extras[COEF], atol=1e-6, rtol=0)
    assert all(math.isfinite(r["vspo/reward_at_0"]) for r in rows)
