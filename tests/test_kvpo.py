"""Paper 21 KVPO (spec 21): the anchor advantage (estimator ``kvpo``) and the Gibbs-surrogate term ``kvpo``,
against hand-worked values (spec 21's unit tests and the arithmetic in each comment)."""

from __future__ import annotations

import pytest
import torch
from helpers import info_for, objective_for, permute_rows, permute_tensor, rollout_from

from groupwise.losses.kvpo import branch_log_probs, kvpo_group_loss
from groupwise.registry import build
from groupwise.types import ANCHOR


def _group(rewards, parts=None, T=2, logp_old=None):
    """One group [1,G,T]: row 0 the anchor, rows 1.. the branches."""
    G = len(rewards)
    lo = torch.zeros(1, G, T) if logp_old is None else torch.as_tensor(logp_old, dtype=torch.float32)
    ro = rollout_from(lo, rewards=torch.tensor([rewards], dtype=torch.float32))
    if parts is not None:
        ro.reward_parts = torch.tensor([parts], dtype=torch.float32)  # [1,G,K]
    ro.set_flag(ANCHOR, torch.arange(G)[None, :] == 0)
    return ro


# ------------------------------------------------------------------ estimator
def test_anchor_advantages_spec_values():
    # r = [0.5, 0.7, 0.3], r_anchor = 0.4: std_unbiased([0.5,0.7,0.3,0.4]) = sqrt(0.0875/3) = 0.170783
    # A = (r − 0.4)/0.170783 = [0.585540, 1.756620, −0.585540]; the anchor row 0
    est = build("advantage", "kvpo", weights=[1.0], fusion="sum")
    adv = est(_group([0.4, 0.5, 0.7, 0.3]), info_for(2))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.585540, 1.756620, -0.585540]]), atol=2e-6, rtol=0)


def test_fusion_std_local_and_global():
    # local: A ∝ [1, 3, −1] (above); population std of [1, 3, −1] = sqrt(8/3) -> [0.612372, 1.837117, −0.612372]
    # global r = [0.2, 0.1, 0.6], anchor 0.3: A ∝ [−1, −2, 3], population std sqrt(14/3)
    #   -> [−0.462910, −0.925820, 1.388730]; fused = local + 0.5·global = [0.380917, 1.374207, 0.081993]
    parts = [[0.4, 0.3], [0.5, 0.2], [0.7, 0.1], [0.3, 0.6]]
    ro = _group([sum(p) for p in parts], parts=parts)
    adv = build("advantage", "kvpo")(ro, info_for(2))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.380917, 1.374207, 0.081993]]), atol=2e-6, rtol=0)


def test_clamp_at_2_5():
    # r = [1, 0, 0, 0] vs anchor 0: std_unbiased([1,0,0,0,0]) = sqrt(0.8/4) = 0.447214, A = [2.236068, 0, 0, 0];
    # weight 2 (fusion sum) -> 4.472136, clamped to 2.5; the mirrored group gives −2.5
    est = build("advantage", "kvpo", weights=[2.0], fusion="sum")
    adv = est(_group([0.0, 1.0, 0.0, 0.0, 0.0]), info_for(2))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 2.5, 0.0, 0.0, 0.0]]))
    adv = est(_group([0.0, -1.0, 0.0, 0.0, 0.0]), info_for(2))
    torch.testing.assert_close(adv, torch.tensor([[0.0, -2.5, 0.0, 0.0, 0.0]]))


def test_estimator_refuses_a_group_without_one_anchor():
    ro = _group([0.4, 0.5, 0.7])
    ro.set_flag(ANCHOR, torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="exactly one valid anchor"):
        build("advantage", "kvpo", weights=[1.0])(ro, info_for(2))


def test_estimator_permutation_equivariant():
    g = torch.Generator().manual_seed(0)
    parts = torch.rand(2, 5, 2, generator=g)
    ro = rollout_from(torch.zeros(2, 5, 3), rewards=parts.sum(-1), reward_parts=parts)
    ro.set_flag(ANCHOR, torch.tensor([[True, False, False, False, False], [False, False, True, False, False]]))
    est = build("advantage", "kvpo")
    perm = torch.stack([torch.randperm(5, generator=g) for _ in range(2)])
    torch.testing.assert_close(est(permute_rows(ro, perm), info_for(3)), permute_tensor(est(ro, info_for(3)), perm))


# ------------------------------------------------------------------ term
def test_gibbs_branch_probabilities():
    # softmax([−1, −2, −3]) = e^{−1,−2,−3}/0.553001 = [0.665241, 0.244728, 0.090031]
    s = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    members = torch.ones(1, 3, dtype=torch.bool)
    p = branch_log_probs(s, members, torch.tensor([False])).exp()
    torch.testing.assert_close(
        p, torch.tensor([[0.665241, 0.244728, 0.090031]], dtype=torch.float64), atol=1e-6, rtol=0
    )
    # with the anchor logit 0: the normaliser is 0.553001 + 1 = 1.553001
    p = branch_log_probs(s, members, torch.tensor([True])).exp()
    torch.testing.assert_close(
        p, torch.tensor([[0.236882, 0.087144, 0.032059]], dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_ratio_and_asymmetric_clip():
    # s = [−1,−2,−3], s_old = [−1,−1,−1] (π_old = 1/3): ρ = 3·π_θ = [1.995723, 0.734185, 0.270092]; A = [1, 1, −1]
    # −min(ρA, clip(ρ, 0.9, 1.2)A) = [−1.2, −0.734185, +0.9] -> mean −0.344728
    s = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    loss, st = kvpo_group_loss(
        s,
        torch.full((1, 3), -1.0, dtype=torch.float64),
        torch.tensor([[1.0, 1.0, -1.0]]),
        torch.ones(1, 3, dtype=torch.bool),
        torch.tensor([False]),
    )
    torch.testing.assert_close(
        st["ratio"], torch.tensor([[1.995723, 0.734185, 0.270092]], dtype=torch.float64), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(loss, torch.tensor([-0.344728], dtype=torch.float64), atol=1e-6, rtol=0)


def test_discrete_kl_to_reference():
    # KL(softmax[−1,−2,−3] ‖ uniform) = Σ p log p + log 3 = −0.832396 + 1.098612 = 0.266217; kl_coef 10 adds 2.66217
    s = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    loss, st = kvpo_group_loss(
        s,
        s,
        torch.zeros(1, 3),
        torch.ones(1, 3, dtype=torch.bool),
        torch.tensor([False]),
        s_ref=torch.zeros(1, 3, dtype=torch.float64),
        kl_coef=10.0,
    )
    torch.testing.assert_close(st["kl"], torch.tensor([0.266217], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(loss, torch.tensor([2.66217], dtype=torch.float64), atol=1e-5, rtol=0)


def _term_loss(ro, logp, **kw):
    term = build("objective", "kvpo", kl_coef=0.0, **kw)
    obj = objective_for([term], "group_mean")
    info = info_for(ro.shape[2])
    return term(ro, {"logp": logp}, info), obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)


def test_term_on_policy_ratio_one_and_unsafe_scale():
    # θ = old (any energies): every ratio is 1, so L = −mean_g A_g over the 3 branches
    lo = torch.tensor([[[0.0, 0.0], [-0.3, -0.1], [-2.0, -0.5], [-0.7, -0.2]]])  # [1,4,2]
    adv = torch.tensor([[0.0, -1.0, -0.5, -2.0]])  # [1,4] (anchor 0)
    # safe: branch 1 beats the anchor on the second column -> L = −(−3.5/3) = 1.166667
    safe = _group([0.0] * 4, parts=[[0.5, 0.5], [0.4, 0.6], [0.1, 0.1], [0.2, 0.3]], logp_old=lo)
    safe.advantages = adv
    values, total = _term_loss(safe, lo.clone().requires_grad_(True))
    torch.testing.assert_close(values, torch.full((1, 4), 1.166667), atol=1e-6, rtol=0)
    torch.testing.assert_close(total, torch.tensor(1.166667), atol=1e-6, rtol=0)
    # unsafe: no branch beats the anchor on either column -> exactly half: 0.583333
    unsafe = _group([0.0] * 4, parts=[[0.5, 0.6], [0.4, 0.6], [0.1, 0.1], [0.2, 0.3]], logp_old=lo)
    unsafe.advantages = adv
    values, total = _term_loss(unsafe, lo.clone().requires_grad_(True))
    torch.testing.assert_close(total, torch.tensor(1.166667 / 2), atol=1e-6, rtol=0)
    _, st = kvpo_group_loss(
        lo.sum(-1)[:, 1:].double(),
        lo.sum(-1)[:, 1:].double(),
        adv[:, 1:],
        torch.ones(1, 3, dtype=torch.bool),
        torch.tensor([True]),
    )
    assert torch.equal(st["ratio"], torch.ones(1, 3, dtype=torch.float64))


def test_term_anchor_row_gets_no_gradient_and_branches_do():
    lo = torch.tensor([[[0.0, 0.0], [-0.3, -0.1], [-2.0, -0.5], [-0.7, -0.2]]])
    ro = _group([0.0] * 4, parts=[[0.5, 0.5], [0.4, 0.6], [0.1, 0.1], [0.2, 0.3]], logp_old=lo)
    ro.advantages = torch.tensor([[0.0, 1.0, -0.5, 0.3]])
    logp = (lo + 0.05).requires_grad_(True)
    _, total = _term_loss(ro, logp)
    (grad,) = torch.autograd.grad(total, logp)
    assert (grad[0, 0] == 0).all()
    assert (grad[0, 1:] != 0).all()


def test_term_permutation_equivariant():
    g = torch.Generator().manual_seed(1)
    lo = -torch.rand(2, 5, 3, generator=g)
    parts = torch.rand(2, 5, 2, generator=g)
    ro = rollout_from(lo, rewards=parts.sum(-1), reward_parts=parts)
    ro.set_flag(ANCHOR, torch.tensor([[True, False, False, False, False], [False, False, True, False, False]]))
    ro.advantages = build("advantage", "kvpo")(ro, info_for(3))
    logp = lo + 0.1 * torch.randn(2, 5, 3, generator=g)
    term = build("objective", "kvpo", kl_coef=0.0)
    perm = torch.stack([torch.randperm(5, generator=g) for _ in range(2)])
    torch.testing.assert_close(
        term(permute_rows(ro, perm), {"logp": permute_tensor(logp, perm)}, info_for(3)),
        permute_tensor(term(ro, {"logp": logp}, info_for(3)), perm),
    )


# ------------------------------------------------------------------ strategy kv_branches and the recipe
def test_plan_kv_routing_draws_older_frames_other_than_the_clean_cache():
    import random

    from groupwise.errors import ConfigError
    from groupwise.rollout.kv_branches import plan_kv_routing

    # frame 2 sits at position 5; keeping the 2 nearest frames (3, 4) leaves one slot, filled from positions
    # < 3 other than the clean cache's 2: {0} or {1}
    plans = plan_kv_routing(5, 3, 2, 40, random.Random(0))
    assert {tuple(p) for p in plans} == {(0,), (1,)}
    # keeping only the nearest frame: 2 slots from positions < 4, C(4, 2) = 6 pairs less the clean (2, 3)
    plans = plan_kv_routing(5, 3, 1, 200, random.Random(0))
    assert {tuple(p) for p in plans} == {(0, 1), (0, 2), (0, 3), (1, 2), (1, 3)}
    with pytest.raises(ConfigError, match="no older frames"):
        plan_kv_routing(3, 3, 2, 4, random.Random(0))  # frame 0: the only older position is the clean one


def _trainer(out, *overrides):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    cfg, _ = load_config(
        "kvpo",
        [
            f'out="{out}"',
            'phases=[{name="sft", steps=40, batch_size=64, update={name="adamw", lr=3e-3}}]',
            "rollout.prompts_per_step=4",
            "eval.size=8",
            "log.samples=0",
            *overrides,
        ],
    )
    return Trainer(build(cfg))


def test_kvpo_recipe_trains_with_anchor_rows_and_resumes_exactly(tmp_path):
    from helpers import assert_resume_is_exact

    summary = assert_resume_is_exact(
        lambda out: _trainer(out, "train.steps=4", "checkpoint.every=2"), tmp_path, steps=4, stop=2
    )
    assert summary["finished"]
    import json

    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["kv/beats_anchor"] <= 1 and r["kv/branch_std"] > 0 for r in rows)  # routing gives spread
    assert all(r["ratio"] == 1.0 for r in rows)  # one epoch: θ = old when the loss is taken


@pytest.mark.slow  # a torchrun pair: make test-slow / test-dist; make test stays under 10 minutes
@pytest.mark.dist
def test_two_ranks_equal_one_process(tmp_path):
    """One KVPO step (SGD, lr 1) over 2 ranks equals one process: each prompt's routing plan is seeded by
    (seed, step, prompt key) and its noise by its request, so the two ranks' groups are the one process's."""
    from helpers import assert_nets_close, train_one_and_two_ranks

    args = ["train", "kvpo", 'phases=[{name="sft", steps=40, batch_size=64, update={name="adamw", lr=3e-3}}]']
    args += ["rollout.prompts_per_step=4", "train.steps=1", "eval.size=0", "log.samples=0"]
    args += ['update={name="sgd", lr=1.0}']
    one, two = (state["net"] for state in train_one_and_two_ranks(args, tmp_path, "ar_flow_policy.pt", 300))
    start = torch.load(tmp_path / "one" / "phases" / "sft.pt", weights_only=False)["policy"]["net"]  # the fit
    assert any(not torch.equal(one[k], start[k]) for k in start)  # the KVPO step moved the fitted net
    assert_nets_close(one, two)


# ------------------------------------------------------------------ the toy's rewards
def _toy_rollout(frames: list[list[float]], target: list[float]):
    import torch as t

    ro = rollout_from(t.zeros(1, 1, 4), prompt_ids=[[0.0, 0.0, 1.0, 0.0, 2.0, 0.0, *target]])
    ro.set_extra("frames", t.tensor([[frames]]), "row")  # [1,1,6,2]
    return ro


def test_traj_rewards_hand_worked():
    import importlib

    traj2d = importlib.import_module("groupwise.papers.21_kvpo.traj2d")
    # history (0,0) (1,0) (2,0); frames at x = 3..8 on the axis, speed 1 throughout; target (8, 1)
    ro = _toy_rollout([[3.0 + i, 0.0] for i in range(6)], [8.0, 1.0])
    # global: −‖(8,0) − (8,1)‖ − mean jerk 0 = −1; local (frames 2..4): ‖(4,0) − τ‖ − ‖(7,0) − τ‖ = √17 − √2
    torch.testing.assert_close(traj2d.TrajGlobal().score_rollout(ro, info_for(4)), torch.tensor([[-1.0]]))
    torch.testing.assert_close(traj2d.TrajLocal().score_rollout(ro, info_for(4)), torch.tensor([[2.708892]]))
    # frame 2 jumps 1.5: speeds 1, 1, 1.5, 1, 1, 1 -> jerks 0, 0, .5, .5, 0, 0 (mean 1/6; frames 2..4: 1/3)
    ro = _toy_rollout([[3.0, 0.0], [4.0, 0.0], [5.5, 0.0], [6.5, 0.0], [7.5, 0.0], [8.5, 0.0]], [8.0, 1.0])
    # global: −√1.25 − 1/6 = −1.284701; local: √17 − ‖(7.5,0) − τ‖ − 1/3 = 4.123106 − 1.118034 − 0.333333
    torch.testing.assert_close(traj2d.TrajGlobal().score_rollout(ro, info_for(4)), torch.tensor([[-1.284701]]))
    torch.testing.assert_close(traj2d.TrajLocal().score_rollout(ro, info_for(4)), torch.tensor([[2.671739]]))


def test_demonstrations_keep_turn_and_speed():
    import importlib

    traj2d = importlib.import_module("groupwise.papers.21_kvpo.traj2d")
    rows = traj2d.traj_rows(32, 3)
    seq = torch.tensor([r["prompt"][:6] + r["target"] for r in rows], dtype=torch.float64).view(32, 9, 2)
    pred = traj2d.continue_curve(seq[:, :-3], seq[:, 1:-2], seq[:, 2:-1])  # [32,6,2] positions 3..8
    torch.testing.assert_close(pred, seq[:, 3:], atol=1e-5, rtol=0)  # every frame continues its last three
    assert float(traj2d.speed_changes(seq).abs().max()) < 1e-5  # the demonstrations keep their speed
