"""The planner kind (K4, latent planner): Gaussian latent actions, then the flow generator
conditioned on them, in one row; log-probs by hand (spec 10's unit test), exact recomputation of
the sampler's log-probs, seeds, greedy, what the generator sees, state round trip, build."""

from __future__ import annotations

import math

import pytest
import torch

from groupwise.modalities.planner import PlannerPolicy
from groupwise.types import Request, StepInfo

INFO = StepInfo(step=3, seed=11, max_new_tokens=0)


def _policy(**kw):
    args = dict(n_labels=12, hidden=16, layers=2, steps=4, dim=4, n_plan=2, plan_dim=3, plan_hidden=8)
    return PlannerPolicy(**{**args, **kw})


def _constant_planner(policy, mean: list[float]):
    """Make μ_k = ``mean`` for every label, role and history (all weights 0, the mean head's bias set)."""
    with torch.no_grad():
        for p in policy.planner.parameters():
            p.zero_()
        policy.planner.mean.bias.copy_(torch.tensor(mean, dtype=torch.float64))


def test_plan_logp_by_hand():
    # spec 10's unit test: a = 0.5, μ = 0.2, σ = 0.5:
    # log N = −0.3²/(2·0.25) − log 0.5 − ½ log 2π = −0.18 + 0.693147 − 0.918939 = −0.405792
    policy = _policy(n_plan=2, plan_dim=1, plan_sigma=0.5)
    _constant_planner(policy, [0.2])
    plan = torch.tensor([[[0.5], [0.2]]], dtype=torch.float64)  # [1,K=2,d=1]
    got = policy.plan_logp(torch.tensor([0]), plan).detach()  # [1,2]
    # second action a = μ: log N = −log 0.5 − ½ log 2π = −0.225792
    torch.testing.assert_close(got, torch.tensor([[-0.405792, -0.225792]], dtype=torch.float64), atol=1e-6, rtol=0)
    # the ratio against an old mean μ = 0: old log N = −0.5 + 0.693147 − 0.918939 = −0.725792 → ρ = e^0.32
    _constant_planner(policy, [0.0])
    old = policy.plan_logp(torch.tensor([0]), plan)[0, 0].detach()
    assert math.isclose(float((got[0, 0] - old).exp()), 1.377128, abs_tol=1e-6)


def test_planner_is_causal_and_reads_the_label():
    policy = _policy()
    a = torch.randn(2, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b[0, 1] += 1.0  # row 0: last action changed
    b[1, 0] += 1.0  # row 1: first action changed
    ma, mb = policy.planner(torch.tensor([3, 3]), a), policy.planner(torch.tensor([3, 3]), b)  # [2,K,d]
    # action k sees actions < k only; to rounding: the planner's Σ_{j<k} a_j is cumsum − a_k (~1e-16 off)
    torch.testing.assert_close(ma[0], mb[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(ma[1, 0], mb[1, 0], atol=1e-12, rtol=0)
    assert (ma[1, 1] - mb[1, 1]).abs().max() > 1e-6
    assert (policy.planner(torch.tensor([3, 4]), a)[0] - policy.planner(torch.tensor([4, 4]), a)[0]).abs().max() > 1e-6


def test_generate_layout_and_exact_recomputation():
    policy = _policy()
    batch = policy.generate([Request(key=2, n=3, prompt=[5]), Request(key=7, n=2, prompt=[0])], {}, INFO)
    assert batch.logp_sampler is not None
    K, steps = 2, 4  # sde = "all": every one of the 4 steps is trained
    assert batch.shape == (2, 3, K + steps) and policy.T == K + steps
    assert batch.extras["part"][0, 0].tolist() == [0.0] * K + [1.0] * steps
    assert batch.extras["part"][1, 2].sum() == 0 and batch.mask[1, 2].sum() == 0  # the padding row
    assert batch.extras["plan"].shape == (2, 3, K, 3) and batch.extras["plan"][1, 2].abs().sum() == 0
    assert batch.extras["x_final"].shape == (2, 3, 4)
    # the plan's sampling log-probs, by the Gaussian formula from the planner's means
    plan = batch.extras["plan"][0].double()  # [3,K,d]
    mean = policy.planner(torch.tensor([5, 5, 5]), plan)  # [3,K,d]
    want = (-((plan - mean) ** 2) / (2 * 0.25) - math.log(0.5) - 0.5 * math.log(2 * math.pi)).sum(-1)  # [3,K]
    torch.testing.assert_close(batch.logp_sampler[0, :, :K], want.float(), atol=1e-6, rtol=0)
    out = policy.forward(batch, ("logp", "entropy"))
    assert torch.equal(out["logp"] * batch.mask, batch.logp_sampler)  # exact at plan and flow positions alike
    # plan entropy per dimension: ½ log(2πe) + log σ = 1.418939 − 0.693147 = 0.725792
    assert math.isclose(float(out["entropy"][0, 0, 0]), 0.725792, abs_tol=1e-6)


def test_rows_are_seeded_per_request_and_greedy_is_the_mean():
    policy = _policy()
    alone = policy.generate([Request(key=7, n=2, prompt=[0])], {}, INFO)
    both = policy.generate([Request(key=2, n=3, prompt=[5]), Request(key=7, n=2, prompt=[0])], {}, INFO)
    assert torch.equal(alone.extras["plan"][0], both.extras["plan"][1, :2])
    assert not torch.equal(both.extras["plan"][0, 0], both.extras["plan"][0, 1])
    _constant_planner(policy, [0.25, -0.5, 1.0])
    greedy = policy.generate([Request(key=2, n=2, prompt=[5])], {"greedy": True}, INFO)
    assert greedy.extras["plan"][0].tolist() == [[[0.25, -0.5, 1.0]] * 2] * 2


def test_generator_sees_label_bag_or_none_and_the_plan():
    g = torch.Generator().manual_seed(0)
    x, s = torch.randn(2, 4, dtype=torch.float64, generator=g), torch.tensor([0.5, 0.5], dtype=torch.float64)
    plan = torch.randn(1, 2, 3, dtype=torch.float64, generator=g).expand(2, 2, 3)  # the same plan for both rows
    labels = torch.tensor([1, 4])
    none = _policy()
    v = none._velocity(x[:1].expand(2, 4), s, labels, plan)
    torch.testing.assert_close(v[0], v[1], atol=1e-12, rtol=0)  # the label never reaches the generator
    # the plan's condition is W_c concat(a_1, a_2), added to the generator's hidden pre-activation
    cond = plan.reshape(2, 6) @ none.planner.inject.weight.T  # [2,H]
    torch.testing.assert_close(v, none.net(x[:1].expand(2, 4), s, None, cond), atol=0, rtol=0)
    other = plan.clone()
    other[1, 0, 0] += 1.0
    assert (none._velocity(x, s, labels, other)[1] - none._velocity(x, s, labels, plan)[1]).abs().max() > 1e-6
    bag = [0, 1, 2, 3, 1, 5, 6, 7, 8, 9, 10, 11]  # labels 1 and 4 share a bag (as (i, j) and (j, i) do)
    bagged = _policy(generator_sees="bag", bag=bag)
    v = bagged._velocity(x[:1].expand(2, 4), s, labels, plan)
    torch.testing.assert_close(v[0], v[1], atol=1e-12, rtol=0)  # (row-batched matmuls may differ in the last ulp)
    seen = _policy(generator_sees="label")
    v = seen._velocity(x[:1].expand(2, 4), s, labels, plan)
    assert (v[0] - v[1]).abs().max() > 1e-6


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="unified"):
        _policy(planner="think_lm")
    with pytest.raises(ValueError, match="bag"):
        _policy(generator_sees="bag")
    with pytest.raises(ValueError, match="bag"):
        _policy(generator_sees="bag", bag=[0] * 5)
    with pytest.raises(ValueError, match="plan_sigma"):
        _policy(plan_sigma=0.0)


def test_state_round_trip_and_build(tmp_path):
    from groupwise.config import ModelCfg
    from groupwise.policy.kinds import build_policy

    policy = _policy(init_seed=3)
    policy.save(tmp_path)
    cfg = ModelCfg(policy="planner", path=str(tmp_path))
    loaded = build_policy(cfg, None)
    assert isinstance(loaded, PlannerPolicy) and loaded.config == policy.config
    batch = policy.generate([Request(key=1, n=2, prompt=[3])], {}, INFO)
    assert torch.equal(loaded.forward(batch)["logp"], policy.forward(batch)["logp"])
    twin = policy.snapshot()
    assert not any(p.requires_grad for p in twin.planner.parameters())
    assert len(policy.parameters()) == len(list(policy.net.parameters())) + len(list(policy.planner.parameters()))


PLANNER = [
    'model.policy="planner"',
    'model.params={n_labels=12, steps=3, sde="all", hidden=16, layers=2, n_plan=2, plan_dim=3, plan_hidden=8}',
    'data.task="flow_attrs"',
    'rewards=[{name="dv_reward", domain="point2d"}]',
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "eval.size=0",
    "threads=1",
    'update={name="sgd", lr=0.1}',
    'objective.agg="token_mean"',
    'objective.terms=["ppo_clip"]',
]


def test_one_update_trains_planner_and_generator_from_one_advantage(tmp_path):
    from groupwise.build import build as build_parts
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    cfg, _ = load_config(None, [*PLANNER, f'out="{tmp_path}"', "train.steps=1"])
    trainer = Trainer(build_parts(cfg))
    policy = trainer.policy
    batch = trainer.prepare(trainer.collect())
    assert batch.advantages is not None
    assert batch.shape[2] == 2 + 3 and batch.advantages.abs().sum() > 0, "a batch with no signal tests nothing"
    # the hand gradient: on-policy ppo_clip (ratio 1, nothing clipped), token_mean:
    # −Σ A_row · ∇logp[b,g,t] / Σ mask over every position, plan and generator alike
    params = policy.parameters()
    logp = policy.forward(batch)["logp"]  # [B,G,T]
    mask = batch.mask & batch.group_valid[..., None]  # [B,G,T]
    ref = -(batch.advantages[..., None] * logp * mask).sum() / mask.sum()
    grads = torch.autograd.grad(ref, params, allow_unused=True)
    want = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]  # the label table is unused
    captured = []
    handle = trainer.updater.optimizer.register_step_pre_hook(
        lambda opt, a, k: (
            captured or captured.extend(torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params)
        )
    )
    trainer.update(batch)
    handle.remove()
    assert len(captured) == len(want)
    for got, w in zip(captured, want):
        torch.testing.assert_close(got.double(), w.double(), atol=1e-6, rtol=1e-5)
    n_flow = len(list(policy.net.parameters()))
    assert max(float(g.abs().max()) for g in want[:n_flow]) > 0 and max(float(g.abs().max()) for g in want[n_flow:]) > 0


def test_a_planner_run_resumes_exactly(tmp_path):
    from groupwise.build import build as build_parts
    from groupwise.config import load_config
    from groupwise.run import Run
    from groupwise.trainer import Trainer

    def trainer(out, steps):
        cfg, _ = load_config(None, [*PLANNER, f'out="{out}"', f"train.steps={steps}", "checkpoint.every=2"])
        return Trainer(build_parts(cfg))

    straight = trainer(tmp_path / "a", 4)
    Run(straight).train()
    Run(trainer(tmp_path / "b", 2)).train()
    resumed = trainer(tmp_path / "b", 4)
    Run(resumed).train(resume_allow=["train.steps"])
    for part in ("net", "planner"):
        for key, value in straight.policy.state_dict()[part].items():
            assert torch.equal(value, resumed.policy.state_dict()[part][key]), (part, key)


def test_alphagrpo_joint_reads_the_part_extra_as_it_reads_image_token():
    from helpers import rollout_from

    from groupwise.registry import build

    term = build("objective", "alphagrpo_joint")
    ratio = torch.tensor([[[1.5, 1.01, 0.99]], [[0.5, 1.0, 1.0005]]])
    parts = torch.tensor([[[0.0, 1.0, 1.0]], [[0.0, 0.0, 1.0]]])
    old, new = (rollout_from(torch.zeros(2, 1, 3), adv=torch.tensor([[7.0], [-2.0]])) for _ in range(2))
    old.set_extra("image_token", parts, "token")
    new.set_extra("part", parts, "token")
    # the same hand values as tests/test_alphagrpo_unified.py::test_joint_loss_by_hand: plan positions take the
    # text clip 0.2 (−8.4, 1.6), generator steps the image clip 1e-3 and A' = clip(A, ±5) (−5.005, −4.95, 2.001)
    want = torch.tensor([[[-8.4, -5.005, -4.95]], [[1.6, 2.0, 2.001]]])
    torch.testing.assert_close(term(new, {"logp": ratio.log()}, INFO), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(term(old, {"logp": ratio.log()}, INFO), want, atol=1e-5, rtol=0)
