"""Paper 37 (Newton's Lantern): the 2-bus power-flow toy solved by hand, the spec's Newton–Raphson
counts, the rewards on a gaussian policy's rollout, the mean anchor by hand and its contract, and the
recipe run (resume, two ranks = one process)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from helpers import assert_nets_close, permute_rows, permute_tensor, train_one_and_two_ranks

from groupwise.losses.mean_anchor import MeanAnchor
from groupwise.modalities.gaussian import GaussianPolicy
from groupwise.tasks import TASKS
from groupwise.types import Request, StepInfo

pf = importlib.import_module("groupwise.papers.37_newtons_lantern.powerflow")
nr = importlib.import_module("groupwise.papers.37_newtons_lantern.nr_rewards")
INFO = StepInfo(step=1, seed=3, max_new_tokens=0)


def _sqrt2(x0: float):
    start = torch.tensor([[x0]], dtype=torch.float64)  # [1,1]
    return pf.newton_raphson(lambda x: x**2 - 2, lambda x: (2 * x)[:, :, None], start, 1e-10, 50)


def test_the_specs_newton_raphson_counts():
    # spec 37: F(x) = x² − 2, |F| < 1e-10: from 1.0 → 1.5, 1.41667, 1.414216, 1.41421356 (4 updates);
    # from 0.01 the first update jumps to 100.005, then halves its way back (11 updates)
    for x0, count in ((1.0, 4), (0.01, 11)):
        x, n, ok = _sqrt2(x0)
        assert int(n) == count and bool(ok) and float(x) == pytest.approx(math.sqrt(2), abs=1e-9)
    # a start that already satisfies the tolerance takes 0 updates; a capped run is not converged
    assert int(_sqrt2(math.sqrt(2))[1]) == 0
    x, n, ok = pf.newton_raphson(lambda x: x**2 - 2, lambda x: (2 * x)[:, :, None], torch.tensor([[1.0]]), 1e-10, 2)
    assert float(x) == pytest.approx(17 / 12) and int(n) == 2 and not bool(ok)  # 1 → 3/2 → 17/12


def test_a_snapshot_solved_by_hand():
    # P_L = 0.25, Q_L = 0, X = 1: u² − u + 1/16 = 0 → u⁺ = (1 + √0.75)/2 = 0.9330127, V = 0.9659258 (cos 15°);
    # sin θ = −0.25/V = −0.2588190 → θ = −15° = −0.2617994; the low root u⁻ = 0.0669873, V⁻ = 0.2588190, θ⁻ = −75°
    theta, v = pf.solution(0.25, 0.0)
    assert v == pytest.approx(math.cos(math.radians(15)), abs=1e-12)
    assert theta == pytest.approx(math.radians(-15), abs=1e-12)
    s = torch.tensor([[0.25, 0.0]], dtype=torch.float64)
    assert pf.mismatch(torch.tensor([[theta, v]], dtype=torch.float64), s).abs().max() < 1e-15
    # the nose point: P_max(k) = (√(1 + k²) − k)/2 → 0.5 at k = 0, (1.25 − 0.75)/2 = 0.25 at k = 0.75
    assert pf.p_max(0.0) == 0.5 and pf.p_max(0.75) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="past the nose point"):
        pf.solution(0.51, 0.0)
    # the first NR update from the flat start (0, 1): F = [0.25, 1 − 1 + 0] = [0.25, 0], J = [[1, 0], [0, 2 − 1]]
    # → step [0.25, 0] → (θ, V) = (−0.25, 1)
    x, n, ok = pf.newton_raphson(lambda x: pf.mismatch(x, s), pf.jacobian, torch.tensor([[0.0, 1.0]]), 1e-8, 1)
    assert x.tolist() == [[-0.25, 1.0]] and int(n) == 1 and not bool(ok)


def test_the_jacobian_is_the_derivative_of_the_mismatch():
    x = torch.tensor([[-0.4, 0.8], [0.1, 1.1]], dtype=torch.float64)
    s = torch.tensor([[0.3, 0.1], [0.2, -0.05]], dtype=torch.float64)
    auto = torch.stack(
        [
            torch.autograd.functional.jacobian(lambda r, i=i: pf.mismatch(r[None], s[i : i + 1])[0], x[i])
            for i in range(2)
        ]
    )
    torch.testing.assert_close(pf.jacobian(x), auto, rtol=0, atol=1e-14)


def test_labels_the_low_root_and_a_singular_start_as_failures():
    s = torch.tensor([[0.25, 0.0]] * 3, dtype=torch.float64)
    low = [math.radians(-75), math.sqrt((1 - math.sqrt(0.75)) / 2)]  # a solution, but the low-voltage one
    starts = torch.tensor([[0.0, 1.0], low, [0.3, 0.0]], dtype=torch.float64)  # flat; low root; V = 0 (J singular)
    label, solved = pf.iterations(starts, s)
    # the flat start: 4 updates (measured; the first one by hand above); both failures are capped at n_max = 20
    assert label.tolist() == [4.0, 20.0, 20.0] and solved.tolist() == [True, False, False]


def test_the_tasks_hold_solved_snapshots_at_their_load_levels():
    test, demos = TASKS["powerflow2"].rows("test", 0, 0), TASKS["powerflow2_demos"].rows("train", 0, 0)
    assert len(test) == pf.TEST_SIZE and all(r["heavy"] and 0.9 <= r["load"] <= 0.98 for r in test)
    assert all(0.1 <= r["load"] <= 0.8 for r in demos)
    train = TASKS["powerflow2"].rows("train", 64, 5)
    assert train == TASKS["powerflow2"].rows("train", 64, 5) and max(r["load"] for r in train) > 0.9
    s, x = (torch.tensor([r[k] for r in test + demos], dtype=torch.float64) for k in ("prompt", "target"))
    assert pf.mismatch(x, s).abs().max() < 1e-12
    # the flat start converges on every heavy snapshot (the toy's NR is robust: README "precondition")
    label, solved = pf.iterations(torch.tensor([[0.0, 1.0]]).expand(len(test), 2), s[: len(test)])
    assert bool(solved.all()) and 5.0 < float(label.mean()) < 6.5  # measured 5.70


def _rollout_with_starts(starts):
    policy = GaussianPolicy()
    requests = [Request(key=0, n=2, prompt=[0.25, 0.0]), Request(key=1, n=1, prompt=[0.25, 0.0])]
    out = policy.generate(requests, {"greedy": True}, INFO)
    out.meta = [{"prompt": [0.25, 0.0]}, {"prompt": [0.25, 0.0]}]
    out.extras["x_final"] = torch.tensor(starts, dtype=torch.float32)  # [B,G,2]
    return out


def test_the_rewards_count_updates_per_row():
    exact = [math.radians(-15), math.cos(math.radians(15))]
    out = _rollout_with_starts([[[0.0, 1.0], [0.3, 0.0]], [exact, [0.0, 0.0]]])  # row (1, 1) is padding
    # flat start 4 updates; V = 0 singular → 20; the float32-rounded exact solution: 1 update (|F| = 1.13e-8 > 1e-8)
    assert nr.NRIterations().score_rollout(out, INFO).tolist() == [[-4.0, -20.0], [-1.0, 0.0]]
    assert nr.NRConverged().score_rollout(out, INFO).tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert nr.NRIterations(n_max=3).score_rollout(out, INFO).tolist() == [[-3.0, -3.0], [-1.0, 0.0]]
    with pytest.raises(ValueError, match="n_max >= 1"):
        nr.NRIterations(n_max=0)


def _anchor_batch():
    policy = GaussianPolicy(sigma=0.2)
    requests = [Request(key=0, n=3, prompt=[0.1, 0.0]), Request(key=1, n=2, prompt=[0.3, 0.1])]
    batch = policy.generate(requests, {}, INFO)
    ref = policy.snapshot()
    with torch.no_grad():
        for p in ref.net.parameters():
            p.add_(0.05)
    batch.set_extra("ref.step_mean", ref.forward(batch, ("step_mean",))["step_mean"], "token")  # [B,G,1,D]
    batch.advantages = torch.zeros(2, 3)
    return policy, batch


def test_the_mean_anchor_by_hand():
    # μ = [1, 2], μ_ref = [0.5, 2.5]: loss = 0.5² + 0.5² = 0.5, ∂/∂μ = 2(μ − μ_ref) = [1, −1]
    policy, batch = _anchor_batch()
    mean = torch.tensor([1.0, 2.0], requires_grad=True)
    step_mean = mean.expand(2, 3, 1, 2) * batch.mask[..., None]  # [B,G,1,D]
    batch.extras["ref.step_mean"] = torch.tensor([0.5, 2.5]).expand(2, 3, 1, 2).clone()
    loss = MeanAnchor()(batch, {"step_mean": step_mean}, INFO)  # [B,G,1]
    assert loss[0, 0, 0].item() == pytest.approx(0.5) and loss[1, 2, 0].item() == 0.0  # padding row
    (grad,) = torch.autograd.grad(loss[0, 0, 0], mean)
    assert grad.tolist() == pytest.approx([1.0, -1.0])


def test_the_mean_anchor_contract():
    policy, batch = _anchor_batch()
    out = policy.forward(batch, ("logp", "step_mean"))
    loss = MeanAnchor()(batch, out, INFO)  # [B,G,1]
    assert loss.shape == batch.mask.shape and loss.dtype == torch.float32 and bool(torch.isfinite(loss).all())
    assert bool((loss[0] > 0).all()) and loss[1, 2].item() == 0.0
    (grad,) = torch.autograd.grad(loss.sum(), out["step_mean"])
    assert grad[1, 2].abs().sum() == 0 and grad[0].abs().sum() > 0  # the padding row gets no gradient
    perm = torch.tensor([[2, 0, 1], [1, 0, 2]])  # [B,G] (group 1 keeps its padding row last)
    shuffled = permute_rows(batch, perm)
    again = MeanAnchor()(shuffled, policy.forward(shuffled, ("logp", "step_mean")), INFO)
    torch.testing.assert_close(again, permute_tensor(loss, perm), rtol=0, atol=0)
    with pytest.raises(ValueError, match="mean_anchor needs out"):
        MeanAnchor()(batch, {"logp": out["logp"]}, INFO)


RECIPE_ARGS = [
    'phases=[{name="sft", task="powerflow2_demos", steps=40, batch_size=32, update={name="adamw", lr=1e-2}}]',
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "train.steps=2",
    "threads=1",
]


def test_the_recipe_deploys_the_mean_and_its_eval_reward_is_minus_the_mean_update_count(tmp_path):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.run import Run
    from groupwise.trainer import Trainer

    cfg, _ = load_config("newtons_lantern", [f'out="{tmp_path}"', "eval.size=32", *RECIPE_ARGS])
    trainer = Trainer(build(cfg))
    summary = Run(trainer).train()
    rows = TASKS["powerflow2"].rows("test", 0, 0)[:32]
    s = torch.tensor([r["prompt"] for r in rows], dtype=torch.float64)  # [32,2]
    obs = torch.tensor([r["prompt"] for r in rows], dtype=torch.float32).double()  # [32,2] as the policy reads it
    # before RL the deployed mean is f0's (the frozen reference after the sft phase), after it the policy's
    for key, net in (("reward_mean_before", trainer.policy.reference.net), ("reward_mean_after", trainer.policy.net)):
        with torch.no_grad():
            mean = net(obs).float().double()  # [32,2] the action is stored in float32 (gaussian Note 3)
        assert summary[key] == pytest.approx(-float(pf.iterations(mean, s)[0].mean()), abs=1e-9), key


@pytest.mark.slow  # a torchrun pair (~20 s): make test-slow / test-dist; make test stays under 10 minutes
@pytest.mark.dist
def test_two_ranks_equal_one_process(tmp_path):
    """Two GRPO steps of the recipe (SGD) over 2 ranks equal one process: the same weights after them."""
    args = ["train", "newtons_lantern", *RECIPE_ARGS, "eval.size=0", 'update={name="sgd", lr=0.1}']
    first, second = train_one_and_two_ranks(args, tmp_path, "gaussian_policy.pt", 300)
    one, ref, two = first["net"], first["reference"], second["net"]
    assert any(not torch.equal(one[k], ref[k]) for k in one)  # RL moved the policy away from f0
    assert_nets_close(one, two)
