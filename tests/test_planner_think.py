"""The planner kind's think-LM planner (``planner = "think_lm"``, K4 absorbing ``unified``): the
``unified`` name is this planner under its old names (same draws, log-probs, weights, checkpoint keys
and config), the think plan's generator condition by hand, refusals that name the fix, and a saved
think-LM planner loading through ``model.path``."""

from __future__ import annotations

import pytest
import torch

from groupwise.config import ModelCfg
from groupwise.errors import ConfigError
from groupwise.modalities.planner import PlannerPolicy
from groupwise.modalities.planner_heads import THINK_VOCAB, ThinkPlanner
from groupwise.modalities.unified import UnifiedPolicy
from groupwise.policy.kinds import build_policy
from groupwise.types import Request, StepInfo

INFO = StepInfo(step=3, seed=11, max_new_tokens=0)
SIZES = dict(n_labels=12, hidden=16, layers=2, steps=4, sde="all")
REQUESTS = [Request(key=2, n=3, prompt=[5]), Request(key=7, n=2, prompt=[0])]


def _think(**kw):
    return PlannerPolicy(**SIZES, planner="think_lm", n_plan=3, plan_hidden=8, **kw)


def test_unified_is_the_think_lm_planner_under_its_old_names():
    unified = UnifiedPolicy(**SIZES, n_think=3, think_hidden=8, flow_sees_label=True)
    planner = _think(generator_sees="label")
    assert isinstance(unified.planner, ThinkPlanner) and unified.think_lm is unified.planner.lm
    for p, q in zip(unified.parameters(), planner.parameters(), strict=True):
        assert torch.equal(p, q)  # the same init streams (flow: init_seed, think LM: init_seed + 1)
    a, b = unified.generate(REQUESTS, {}, INFO), planner.generate(REQUESTS, {}, INFO)
    for name in ("actions", "mask", "logp_sampler"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.extras["image_token"], b.extras["part"]) and "part" not in a.extras
    assert torch.equal(a.extras["think_ids"], b.extras["think_ids"])
    assert torch.equal(a.extras["x_final"], b.extras["x_final"])
    assert torch.equal(unified.forward(a)["logp"], planner.forward(b)["logp"])
    # the checkpoint keys stay the unified policy's; only the config (and the file name) differ
    assert unified.state_dict()["think"].keys() == planner.state_dict()["think"].keys()
    assert (
        list(unified.config)[-3:] == ["n_think", "think_hidden", "flow_sees_label"] and "planner" not in unified.config
    )
    assert (unified.policy_file, planner.policy_file) == ("flow_policy.pt", "planner_policy.pt")
    assert planner.config["planner"] == "think_lm" and "plan_dim" not in planner.config


def test_think_plan_condition_by_hand():
    policy = _think()
    with torch.no_grad():
        policy.planner.emb.weight.copy_(torch.arange(7 * 16, dtype=torch.float64).view(7, 16))  # E[v] = 16v .. 16v+15
    # plan (0, 2, 2): E[0] + 2 E[2] = [0..15] + 2·[32..47] -> element h: h + 2(32 + h) = 64 + 3h
    got = policy.plan_condition(torch.tensor([[0, 2, 2]]))  # [1,H]
    assert got[0].tolist() == [64.0 + 3 * h for h in range(16)]
    x, s = torch.zeros(1, 2, dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)
    torch.testing.assert_close(
        policy._velocity(x, s, torch.tensor([4]), torch.tensor([[0, 2, 2]])),
        policy.net(x, s, None, got),
        atol=0,
        rtol=0,
    )  # generator_sees = "none": the label does not enter, the plan's condition does


def test_think_planner_samples_and_rescores_exactly():
    policy = _think()
    batch = policy.generate(REQUESTS, {}, INFO)
    n, steps = 3, 4
    assert batch.shape == (2, 3, n + steps) and batch.extras["part"][0, 0].tolist() == [0.0] * n + [1.0] * steps
    assert torch.equal(batch.extras["think_ids"], batch.actions[:, :, :n]) and int(batch.actions.max()) < len(
        THINK_VOCAB
    )
    out = policy.forward(batch, ("logp", "entropy"))
    torch.testing.assert_close(out["logp"] * batch.mask, batch.logp_sampler, atol=1e-6, rtol=0)
    # the categorical entropy of position 0 by hand from the think LM's logits
    logq = torch.log_softmax(policy.planner.lm(torch.tensor([5]), batch.actions[0, :1, :n]), -1)[0, 0]  # [V]
    torch.testing.assert_close(out["entropy"][0, 0, 0], -(logq.exp() * logq).sum().float(), atol=1e-6, rtol=0)
    assert policy.think_text(batch)[0][0] == " ".join(THINK_VOCAB[int(t)] for t in batch.actions[0, 0, :n])


def test_think_planner_refusals_name_the_fix():
    with pytest.raises(ValueError, match="plan_dim and plan_sigma are the latent planner's"):
        _think(plan_sigma=0.3)
    with pytest.raises(ValueError, match="think_text reads a think-LM plan"):
        PlannerPolicy(**SIZES).think_text(PlannerPolicy(**SIZES).generate(REQUESTS[:1], {}, INFO))


def test_a_saved_think_planner_loads_through_model_path(tmp_path):
    policy = _think(init_seed=4)
    policy.save(tmp_path)
    loaded = build_policy(ModelCfg(policy="planner", path=str(tmp_path)), None)
    assert isinstance(loaded.planner, ThinkPlanner) and loaded.config == policy.config
    batch = policy.generate(REQUESTS, {}, INFO)
    assert torch.equal(loaded.forward(batch)["logp"], policy.forward(batch)["logp"])
    with pytest.raises(ConfigError, match="change the architecture"):
        build_policy(ModelCfg(policy="planner", path=str(tmp_path), params={"n_plan": 2}), None)


def test_lac_align_refuses_the_think_planner():
    from types import SimpleNamespace

    from groupwise.phases import lac_align as lac

    ctx = SimpleNamespace(policy=PlannerPolicy(n_labels=12, dim=4, planner="think_lm"), train_rows=[], seed=0)
    with pytest.raises(ConfigError, match=r"'think_lm', dim 4"):  # its stage 1 fits Gaussian latents
        lac.LacAlign(steps=1)(ctx)


def test_a_think_planner_run_equals_the_unified_run(tmp_path):
    # the same toy under both names: alphagrpo_joint reads `part` (planner) as it reads `image_token` (unified)
    from groupwise.build import build as build_parts
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    common = [
        'data.task="flow_attrs"',
        'rewards=[{name="dv_reward", domain="point2d"}]',
        'advantage.estimator="alphagrpo"',
        'objective.terms=["alphagrpo_joint", {name="kl", coef=0.04}]',
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        "eval.size=0",
        "threads=1",
    ]
    sizes = 'n_labels=12, steps=3, sde="all", hidden=16'
    kinds = {
        "unified": ['model.policy="unified"', f"model.params={{{sizes}, n_think=3, think_hidden=8}}"],
        "planner": ['model.policy="planner"', f'model.params={{{sizes}, planner="think_lm", n_plan=3, plan_hidden=8}}'],
    }
    rows, states = {}, {}
    for kind, model in kinds.items():
        cfg, _ = load_config(None, [*model, *common, f'out="{tmp_path / kind}"', "train.steps=2"])
        trainer = Trainer(build_parts(cfg))
        rows[kind] = [{k: v for k, v in trainer.run_step().items() if "seconds" not in k and "per_s" not in k}]
        rows[kind].append({k: v for k, v in trainer.run_step().items() if "seconds" not in k and "per_s" not in k})
        states[kind] = trainer.policy.state_dict()
    assert rows["unified"] == rows["planner"] and rows["planner"][1]["grad_norm"] > 0
    for part in ("net", "think", "reference", "reference_think"):
        for key, value in states["unified"][part].items():
            assert torch.equal(value, states["planner"][part][key]), (part, key)
