"""Curricula: CGPO (spec 05), FG-ExPO GCS + AKL (spec 36), and the mixed-difficulty task.

Hand-computed spec numbers, edge cases, exact resume, draw determinism, simulated bandits (no LM),
and one short run through the trainer per component.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import rollout_from

from groupwise.registry import build
from groupwise.run import Run
from groupwise.sampling.cgpo import category_weights, group_variance, normalize_variances, proposal_probs
from groupwise.sampling.gcs import gaussian_curriculum_probs, gaussian_weights
from groupwise.schedules import resolve
from groupwise.schedules.akl import akl_beta, batch_accuracy
from groupwise.types import StepInfo

NAN = float("nan")


def info(step: int, round_: int = 0, seed: int = 0) -> StepInfo:
    return StepInfo(step=step, seed=seed, max_new_tokens=4, round=round_)


def scored(rewards, prompt_index, meta=None, group_valid=None):
    """A scored Rollout [B,G,1] with the given rewards [B,G] and dataset rows [B]."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)  # [B,G]
    B, G = rewards.shape
    fields = dict(rewards=rewards, prompt_index=torch.as_tensor(prompt_index, dtype=torch.long))
    if meta is not None:
        fields["meta"] = meta
    if group_valid is not None:
        fields["group_valid"] = torch.as_tensor(group_valid, dtype=torch.bool)
    return rollout_from(torch.zeros(B, G, 1), None, **fields)


def sampler(name, n_rows=10, seed=3, **params):
    s = build("sampling", name, **params)
    s.bind(n_rows, seed)
    return s


def two_values(var: float) -> list[float]:
    """Two rewards 0.5 ± d with population variance d² = var."""
    d = math.sqrt(var)
    return [0.5 - d, 0.5 + d]


# ====================================================================== CGPO (spec 05)
def test_cgpo_population_variance_minmax_spec_numbers():
    # spec: V = [0, 0.25, 0.1, 0.04] → (V − 0)/(0.25 − 0) = [0, 1, 0.4, 0.16]
    torch.testing.assert_close(
        normalize_variances(torch.tensor([0.0, 0.25, 0.1, 0.04], dtype=torch.float64)),
        torch.tensor([0.0, 1.0, 0.4, 0.16], dtype=torch.float64),
    )
    # the same from rewards: [1,1] V=0; [0,1] V=0.25 (population: ((−.5)²+(.5)²)/2; unbiased would be 0.5)
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], two_values(0.1), two_values(0.04)])  # [4,2]
    torch.testing.assert_close(
        proposal_probs(rewards), torch.tensor([0.0, 1.0, 0.4, 0.16], dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_cgpo_history_mean_and_unselected_bonus():
    s = sampler("cgpo", n_rows=100, init_prob=0.3)
    # batch: row 0 (V = 0.05 → 0.05/0.25 = 0.2), row 1 ([0,1]: V = 0.25 = max → 1), row 2 ([1,1]: V = 0 = min → 0)
    for step, var0 in enumerate([0.05, 0.1, 0.25]):  # P_var(0) = 0.2, 0.4, 1.0
        s.observe(scored([two_values(var0), [0.0, 1.0], [1.0, 1.0]], [0, 1, 2]), info(step))
        if step == 0:
            assert s._probabilities()[3].item() == pytest.approx(0.31)  # unselected: 0.3 + 1/N = 0.3 + 0.01
            assert s._probabilities()[0].item() == pytest.approx(0.2)  # history [0.2] → 0.2
    # spec: history [0.2, 0.4, 1.0] → (0.2 + 0.4 + 1.0)/3 = 0.5333
    assert s._probabilities()[0].item() == pytest.approx(1.6 / 3, abs=1e-6)
    assert s._probabilities()[2].item() == 0.0 and s._probabilities()[1].item() == 1.0
    assert s._probabilities()[3].item() == pytest.approx(0.33)  # three unselected steps: 0.3 + 3/100
    # a fourth selection drops the oldest: [0.4, 1.0, 0.0] → 0.4667
    s.observe(scored([[1.0, 1.0], [0.0, 1.0]], [0, 1]), info(3))
    assert s._probabilities()[0].item() == pytest.approx(1.4 / 3, abs=1e-6)


def test_cgpo_bonus_and_clip_options():
    s = sampler("cgpo", n_rows=4, init_prob=0.95, bonus=0.1)
    s.observe(scored([[0.0, 1.0]], [0]), info(0))  # rows 1..3 unselected: 0.95 + 0.1 = 1.05 → clipped 1
    assert s._probabilities().tolist() == [1.0, 1.0, 1.0, 1.0] and s._table[1].item() == 1.0
    s = sampler("cgpo", n_rows=4, init_prob=0.95, bonus=0.1, clip=False)
    s.observe(scored([[0.0, 1.0]], [0]), info(0))
    assert s._table[1].item() == pytest.approx(1.05) and s._probabilities()[1].item() == 1.0  # acceptance capped at 1


def test_cgpo_category_calibration_spec_numbers():
    # spec: r = [0.5, 0.8]: 1/r = [2, 1.25], Σ = 3.25 → v = [0.615385, 0.384615];
    # q = (1 + v)/(2 + 1) = [0.538462, 0.461538] (the weaker category gets more); w = c·q = [1.076923, 0.923077]
    q = category_weights(torch.tensor([0.5, 0.8]), lam=1.0)
    torch.testing.assert_close(q, torch.tensor([0.538462, 0.461538], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        category_weights(torch.tensor([0.3, 0.3, 0.3])), torch.full((3,), 1 / 3, dtype=torch.float64)
    )  # equal → q uniform
    assert category_weights(torch.tensor([0.0, 0.5]))[0] > 0.5  # r = 0 is floored, not a division by zero
    # through the sampler: level "a" mean 2/4 = 0.5, level "b" mean 4/5 = 0.8, calibration after step 0
    s = build("sampling", "cgpo", category_column="level", calib_every=1, init_prob=0.5)
    s.bind(6, 3, rows=[{"level": "a"}, {"level": "b"}, {"level": "b"}, {}, {}, {}])  # rows 3-5 have no category
    meta = [{"level": "a"}, {"level": "b"}]
    s.observe(scored([[1.0, 0.0, 1.0, 0.0, NAN], [1.0, 1.0, 1.0, 1.0, 0.0]], [0, 1], meta), info(0))
    assert s._w == pytest.approx({"a": 2 * 0.538462, "b": 2 * 0.461538}, abs=1e-6)
    # row 0 (a): V = 0.25 = max → P_var 1, × 1.0769 → capped at 1; row 1 (b): V = 0.16 = min → 0
    # row 2 (b, unselected): (0.5 + 1/6) × 0.923077 = 0.615385; row 3 (no category): weight 1 → 0.666667
    prob = s._probabilities()
    assert prob[:4].tolist() == pytest.approx([1.0, 0.0, 0.615385, 0.5 + 1 / 6], abs=1e-6)
    with pytest.raises(KeyError, match="level"):
        s.observe(scored([[1.0, 0.0]], [2], [{"answer": "1"}]), info(1))
    with pytest.raises(ValueError, match="meta"):
        s.observe(scored([[1.0, 0.0]], [2]), info(1))


def test_cgpo_calibration_period_and_bind_rows():
    s = build("sampling", "cgpo", category_column="level", calib_every=2)
    s.bind(3, 0, rows=[{"level": 0}, {"level": 1}, {"level": 1}])  # categories known before any observation
    s.observe(scored([[0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]], [0, 1], [{"level": 0}, {"level": 1}]), info(0))
    assert s._w == {}  # (0 + 1) % 2 != 0: no calibration yet
    s.observe(scored([[0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]], [0, 1], [{"level": 0}, {"level": 1}]), info(1))
    # r = [0.25, 0.75]: 1/r = [4, 4/3] → v = [0.75, 0.25]; q = (1 + v)/3 → w = 2q = [7/6, 5/6]
    assert s._w == pytest.approx({0: 7 / 6, 1: 5 / 6})
    # row 2: level 1 from bind, table 1 (1 + 2/3 clipped) × 5/6
    assert s._probabilities()[2].item() == pytest.approx(5 / 6)


def test_cgpo_edge_cases_nan_constant_and_flat_batches():
    s = sampler("cgpo", n_rows=5, init_prob=0.5)
    # all-NaN group (row 0): ignored, no bonus; constant groups with spread elsewhere: P_var 0; one valid row: V = 0
    s.observe(scored([[NAN, NAN], [1.0, 1.0], [0.0, 1.0], [NAN, 1.0]], [0, 1, 2, 3]), info(0))
    assert s._probabilities().tolist() == pytest.approx([0.5, 0.0, 1.0, 0.0, 0.5 + 1 / 5])
    assert 0 not in s._hist and len(s._hist) == 3
    # a batch with no spread (every group constant): every P_var = flat_value
    s.observe(scored([[1.0, 1.0], [0.0, 0.0]], [1, 2]), info(1))
    assert s._hist[1] == [0.0, 1.0] and s._hist[2] == [1.0, 1.0]
    t = sampler("cgpo", n_rows=3, flat_value=0.25)
    t.observe(scored([[1.0, 1.0], [0.0, 0.0]], [0, 1]), info(0))
    assert t._probabilities()[:2].tolist() == [0.25, 0.25]
    assert normalize_variances(torch.tensor([0.3])).tolist() == [1.0]  # a single group has no spread
    var, has = group_variance(
        torch.tensor([[NAN, NAN]]), torch.tensor([[True, True]]) & torch.isfinite(torch.tensor([[NAN, NAN]]))
    )
    assert var.tolist() == [0.0] and has.tolist() == [False]
    t.observe(scored([[NAN, NAN]], [2]), info(1))  # a batch with nothing valid changes nothing but the bonus of others
    assert t._probabilities()[2].item() == 1.0


def test_cgpo_draw_follows_the_table():
    s = sampler("cgpo", n_rows=8, init_prob=0.0)
    s.load_state_dict({**s.state_dict(), "table": [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]})
    for step in range(5):
        ids = s.draw(3, info(step))
        assert sorted(ids) == [0, 2, 4]  # P = 1 rows are always accepted, P = 0 never (3 distinct needed)
    ids = s.draw(5, info(0))  # only 3 rows can be accepted: after max_passes the rest is filled uniformly
    assert len(set(ids)) == 5 and set(ids[:3]) == {0, 2, 4}
    with pytest.raises(ValueError, match="distinct"):
        s.draw(9, info(0))
    assert len(sampler("cgpo", n_rows=3, replace=True).draw(7, info(0))) == 7
    with pytest.raises(RuntimeError, match="bind"):
        build("sampling", "cgpo").draw(1, info(0))


# ====================================================================== GCS (spec 36)
def test_gcs_part_a_weights_and_probabilities():
    # w = exp(−(p − 0.5)²/0.08): p = 0 → e^{−3.125} = 0.04394; 0.25 → e^{−0.78125} = 0.45783
    p = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])
    torch.testing.assert_close(
        gaussian_weights(p),
        torch.tensor([0.04394, 0.45783, 1, 0.45783, 0.04394], dtype=torch.float64),
        atol=1e-5,
        rtol=0,
    )
    # Σw = 2.00354 → P = w/Σw
    torch.testing.assert_close(
        gaussian_curriculum_probs(p),
        torch.tensor([0.02193, 0.22852, 0.49911, 0.22852, 0.02193], dtype=torch.float64),
        atol=1e-5,
        rtol=0,
    )


def test_gcs_part_b_probabilities_with_and_without_floor():
    p = torch.tensor([0.5, 0.3, 0.0, 1.0])
    # w = [1, e^{−0.5} = 0.606531, 0.043937, 0.043937], Σ = 1.694405
    torch.testing.assert_close(
        gaussian_weights(p), torch.tensor([1, 0.606531, 0.043937, 0.043937], dtype=torch.float64), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        gaussian_curriculum_probs(p),
        torch.tensor([0.590178, 0.357961, 0.025931, 0.025931], dtype=torch.float64),
        atol=1e-6,
        rtol=0,
    )
    # ε = 0.01: (w + 0.01)/(1.694405 + 0.04)
    torch.testing.assert_close(
        gaussian_curriculum_probs(p, eps=0.01),
        torch.tensor([0.582332, 0.355471, 0.031098, 0.031098], dtype=torch.float64),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize("eps", [0.0, 0.01])
def test_gcs_100k_draws_match_the_probabilities(eps):
    s = sampler("gcs", n_rows=5, eps=eps, replace=True)
    # group accuracies 0, 1/4, 2/4, 3/4, 4/4 (decay 0: the last observation)
    s.observe(scored([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], [0, 1, 2, 3, 4]), info(0))
    expected = gaussian_curriculum_probs(torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]), eps=eps)  # [5]
    torch.testing.assert_close(s._probabilities(), expected)
    counts = torch.bincount(torch.tensor(s.draw(100_000, info(1))), minlength=5).double() / 100_000  # [5]
    assert (counts - expected).abs().max() < 0.01, (counts, expected)


def test_gcs_without_replacement_and_errors():
    s = sampler("gcs", n_rows=6)
    for step in range(20):
        ids = s.draw(6, info(step))
        assert sorted(ids) == list(range(6))  # a batch never repeats a question
    with pytest.raises(ValueError, match="distinct"):
        s.draw(7, info(0))
    with pytest.raises(RuntimeError, match="bind"):
        build("sampling", "gcs").draw(1, info(0))
    with pytest.raises(ValueError, match="sigma"):
        build("sampling", "gcs", sigma=0.0)


def test_gcs_accuracy_estimates_and_options():
    s = sampler("gcs", n_rows=4)
    assert s._accuracy().tolist() == [0.5] * 4  # unseen → μ
    assert sampler("gcs", n_rows=2, mu=0.3)._accuracy().tolist() == [0.3, 0.3]
    assert sampler("gcs", n_rows=2, mu=0.3, unseen=0.5)._accuracy().tolist() == [0.5, 0.5]  # Part A's unseen = 0.5
    # all-NaN group (row 1): unchanged; decay 0: the last observation
    s.observe(scored([[1.0, 1.0, 1.0, 1.0], [NAN, NAN, NAN, NAN]], [0, 1]), info(0))
    s.observe(scored([[0.0, 0.0, 1.0, NAN]], [0]), info(1))
    assert s._accuracy().tolist() == pytest.approx([1 / 3, 0.5, 0.5, 0.5])
    e = sampler("gcs", n_rows=2, decay=0.5)  # first observation 1.0, then 0.5·1.0 + 0.5·0.0 = 0.5
    e.observe(scored([[1.0, 1.0]], [0]), info(0))
    e.observe(scored([[0.0, 0.0]], [0]), info(1))
    assert e._accuracy()[0].item() == 0.5
    m = sampler("gcs", n_rows=2, estimate="mean")  # running mean over every reward: (4 + 0)/(4 + 2) = 2/3
    m.observe(scored([[1.0, 1.0, 1.0, 1.0]], [0]), info(0))
    m.observe(scored([[0.0, 0.0, NAN, NAN]], [0]), info(1))
    assert m._accuracy()[0].item() == pytest.approx(2 / 3)
    t = sampler("gcs", n_rows=1, threshold=0.5)  # graded rewards: share ≥ 0.5 of [0.7, 0.2] = 0.5
    t.observe(scored([[0.7, 0.2]], [0]), info(0))
    assert t._accuracy()[0].item() == 0.5
    v = sampler("gcs", n_rows=2)  # a row marked invalid by group_valid is excluded like a NaN
    v.observe(scored([[1.0, 0.0]], [0], group_valid=[[True, False]]), info(0))
    assert v._accuracy()[0].item() == 1.0


# ====================================================================== both samplers: determinism and resume
def _simulate(s, solve, steps, start=0, B=4, G=8, seed=0):
    """Draw, simulate Bernoulli(solve[row]) rewards, observe; returns the draws."""
    draws = []
    for step in range(start, start + steps):
        ids = s.draw(B, info(step))
        g = torch.Generator().manual_seed(seed * 7919 + step)
        rewards = (torch.rand(len(ids), G, generator=g) < solve[ids][:, None]).float()  # [B,G]
        s.observe(scored(rewards, ids, [{"level": int(i) % 3} for i in ids]), info(step))
        draws.append(ids)
    return draws


SAMPLERS = [
    ("cgpo", {}),
    ("cgpo", {"category_column": "level", "calib_every": 2}),
    ("gcs", {}),
    ("gcs", {"estimate": "mean", "eps": 0.0}),
]


@pytest.mark.parametrize("name,params", SAMPLERS)
def test_exact_resume(name, params):
    solve = torch.linspace(0, 1, 12)  # [12]
    a = sampler(name, n_rows=12, seed=5, **params)
    _simulate(a, solve, 6)
    state = json.loads(json.dumps(a.state_dict()))  # plain data
    expected = _simulate(a, solve, 5, start=6)
    b = build("sampling", name, **params)
    b.load_state_dict(state)  # load before bind ...
    b.bind(12, 5)
    c = sampler(name, n_rows=12, seed=5, **params)
    c.load_state_dict(state)  # ... or after
    assert _simulate(b, solve, 5, start=6) == expected == _simulate(c, solve, 5, start=6)
    assert json.dumps(b.state_dict()) == json.dumps(a.state_dict())
    with pytest.raises(ValueError, match="rows"):
        sampler(name, n_rows=13, **params).load_state_dict(state)


@pytest.mark.parametrize("name,params", SAMPLERS[::2])
def test_draw_depends_only_on_seed_step_round_and_table(name, params):
    a, b = sampler(name, n_rows=50, **params), sampler(name, n_rows=50, **params)
    for step in range(7):  # a has drawn before, b never did
        a.draw(5, info(step))
    assert a.draw(5, info(7)) == b.draw(5, info(7))
    assert a.draw(5, info(7)) != a.draw(5, info(8))  # another step
    assert a.draw(5, info(7)) != a.draw(5, info(7, round_=1))  # another refill round
    assert sampler(name, n_rows=50, seed=1, **params).draw(5, info(7)) != sampler(
        name, n_rows=50, seed=2, **params
    ).draw(5, info(7))


# ====================================================================== behaviour: simulated bandits, no LM
def _degenerate_fraction(s, solve, steps, B, G, skip):
    frac = []
    for step in range(steps):
        ids = s.draw(B, info(step))
        g = torch.Generator().manual_seed(1000 + step)
        rewards = (torch.rand(B, G, generator=g) < solve[ids][:, None]).float()  # [B,G]
        if hasattr(s, "observe"):
            s.observe(scored(rewards, ids), info(step))
        if step >= skip:
            frac.append(float((rewards.max(1).values == rewards.min(1).values).float().mean()))
    return sum(frac) / len(frac)


def test_gcs_raises_the_share_of_non_degenerate_groups_on_a_bandit():
    solve = torch.rand(200, generator=torch.Generator().manual_seed(0))  # 200 questions, U(0,1) solve rates
    uniform = 1 - _degenerate_fraction(sampler("uniform", n_rows=200), solve, 150, 16, 8, skip=50)
    gcs = 1 - _degenerate_fraction(sampler("gcs", n_rows=200), solve, 150, 16, 8, skip=50)
    print(f"non-degenerate groups: uniform {uniform:.3f}, gcs {gcs:.3f}")
    assert 0.7 < uniform < 0.85  # analytic 1 − 2/9 = 0.778
    assert gcs > uniform + 0.08 and gcs > 0.88


def test_cgpo_moves_mass_to_the_learnable_bucket():
    # 300 prompts: easy (always solved), learnable (p = 0.5), impossible (never): 100 each
    solve = torch.tensor([1.0] * 100 + [0.5] * 100 + [0.0] * 100)
    s = sampler("cgpo", n_rows=300)
    draws = _simulate(s, solve, 80, B=16)
    late = torch.tensor(draws[-30:]).flatten()  # [480]
    learnable = float(((late >= 100) & (late < 200)).float().mean())
    print(f"share of learnable prompts in the last 30 batches: cgpo {learnable:.3f}, uniform 0.333")
    assert learnable > 0.65
    uniform = _degenerate_fraction(sampler("uniform", n_rows=300), solve, 80, 16, 8, skip=50)
    cgpo = _degenerate_fraction(sampler("cgpo", n_rows=300), solve, 80, 16, 8, skip=50)
    print(f"zero-variance groups: uniform {uniform:.3f}, cgpo {cgpo:.3f}")
    assert cgpo < uniform - 0.3


def test_cgpo_migrates_to_prompts_that_become_partly_solved():
    # "hard" prompts are impossible until step 40, then solved half the time: the curriculum finds them again
    s = sampler("cgpo", n_rows=200)
    share = []
    for step in range(90):
        solve = torch.tensor([0.5] * 100 + [0.0 if step < 40 else 0.5] * 100)
        ids = _simulate_one(s, solve, step)
        share.append(sum(i >= 100 for i in ids) / len(ids))
    before, after = sum(share[25:40]) / 15, sum(share[75:90]) / 15
    print(f"share of hard prompts: steps 25-40 {before:.3f}, steps 75-90 {after:.3f}")
    assert before < 0.2 and after > 0.3 and after > 2.5 * before


def _simulate_one(s, solve, step, B=16, G=8):
    ids = s.draw(B, info(step))
    g = torch.Generator().manual_seed(step)
    rewards = (torch.rand(B, G, generator=g) < solve[ids][:, None]).float()  # [B,G]
    s.observe(scored(rewards, ids), info(step))
    return ids


# ====================================================================== AKL (spec 36)
@pytest.mark.parametrize(
    "beta_max,expected",
    [
        (1.0, [0.047426, 0.5, 0.952574]),  # Part A: σ(10·(−0.3)) = 1/(1 + e³) = 0.047426; σ(0) = 0.5; σ(3) = 0.952574
        (0.1, [0.0047426, 0.05, 0.0952574]),  # Part B: the same × 0.1
    ],
)
def test_akl_spec_values(beta_max, expected):
    got = [akl_beta(acc, beta_min=0.0, beta_max=beta_max, k=10.0, center=0.5) for acc in (0.2, 0.5, 0.8)]
    assert got == pytest.approx(expected, abs=1e-6 * beta_max)  # the spec's 6 significant digits


def test_akl_shapes():
    # tanh: (1 + tanh(x))/2 = σ(2x), so tanh with k = 5 equals the sigmoid with k = 10
    assert akl_beta(0.8, 0, 1, k=5, shape="tanh") == pytest.approx(0.952574, abs=1e-6)
    assert akl_beta(0.5, 0.01, 0.05, shape="power") == pytest.approx(0.01 + 0.04 * 0.25)  # γ = 2: 0.5² = 0.25
    assert akl_beta(0.5, 0, 1, shape="power", gamma=0.5) == pytest.approx(math.sqrt(0.5))
    assert akl_beta(1.3, 0, 1, shape="power") == 1.0 and akl_beta(-1.0, 0, 1, shape="power") == 0.0  # clipped accuracy
    for shape in ("sigmoid", "tanh", "power"):
        values = [akl_beta(a / 10, 0.0, 0.04, shape=shape) for a in range(11)]
        # increasing, bounded
        assert all(x < y for x, y in zip(values, values[1:])) and 0 <= values[0] and values[-1] <= 0.04
    with pytest.raises(ValueError, match="shape"):
        akl_beta(0.5, shape="cubic")
    with pytest.raises(ValueError, match="shape"):
        build("schedule", "akl", shape="cubic")


def test_akl_schedule_reads_batch_accuracy():
    sched = build("schedule", "akl", beta_max=0.1)
    assert sched.start() == pytest.approx(0.05)  # β at acc = center before any step
    # valid: [1, 0] (NaN excluded) + [1, 1, 0] → 3/5 = 0.6 → 0.1·σ(1) = 0.0731059
    ro = scored([[1.0, 0.0, NAN], [1.0, 1.0, 0.0]], [0, 1])
    assert batch_accuracy(ro) == pytest.approx(0.6)
    assert sched(info(0), ro) == pytest.approx(0.1 / (1 + math.exp(-1.0)))
    # a row excluded by group_valid does not count: [1] + [1, 1, 0] → 0.75
    assert batch_accuracy(scored([[1.0, 0.0], [1.0, 1.0]], [0, 1], group_valid=[[True, False], [True, True]])) == 1.0
    # a batch without any valid reward keeps β
    assert sched(info(1), scored([[NAN, NAN]], [0])) == pytest.approx(0.0731059, abs=1e-7)
    graded = build("schedule", "akl", beta_max=1.0, threshold=0.5)  # share ≥ 0.5 of [0.9, 0.3, 0.6, 0.1] = 0.5
    assert graded(info(0), scored([[0.9, 0.3, 0.6, 0.1]], [0])) == pytest.approx(0.5)


def test_akl_ema_and_resume():
    sched = build("schedule", "akl", beta_max=1.0, ema_decay=0.9)
    # first: acc_s = 0.2
    assert sched(info(0), scored([[1.0, 0.0, 0.0, 0.0, 0.0]], [0])) == pytest.approx(0.047426, abs=1e-6)
    # acc 0.8: acc_s = 0.9·0.2 + 0.1·0.8 = 0.26 → σ(10·(−0.24)) = σ(−2.4) = 0.0831727
    batch = scored([[1.0, 1.0, 1.0, 1.0, 0.0]], [0])
    assert sched(info(1), batch) == pytest.approx(1 / (1 + math.exp(2.4)))
    state = json.loads(json.dumps(sched.state_dict()))
    expected = sched(info(2), batch)  # 0.9·0.26 + 0.1·0.8 = 0.314
    fresh = build("schedule", "akl", beta_max=1.0, ema_decay=0.9)
    fresh.load_state_dict(state)
    assert fresh.start() == pytest.approx(1 / (1 + math.exp(2.4)))  # after a resume: the last β
    assert fresh(info(2), batch) == expected == pytest.approx(1 / (1 + math.exp(-10 * (0.314 - 0.5))))


def test_akl_as_a_kl_coefficient():
    term = build("objective", "kl", coef={"schedule": "akl", "beta_max": 0.08})
    assert term.coef == pytest.approx(0.04) and type(term.schedules["coef"]).__name__ == "AKLSchedule"
    logged = resolve([term], info(0), scored([[0.0, 0.0, 0.0, 1.0, 0.0]], [0]))  # acc 0.2 → 0.08·0.047426
    assert term.coef == pytest.approx(0.08 * 0.047426, abs=1e-7) and logged == {"coef/kl.coef": term.coef}


# ====================================================================== the mixed task
def test_mixed_task_levels_splits_and_answers():
    from collections import Counter

    from groupwise.tasks import get_task
    from groupwise.tasks.mixed import LEVELS, TEST_PER_LEVEL

    task = get_task("mixed")
    train, test = task.rows("train", 0, 0), task.rows("test", 0, 0)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert Counter(r["level"] for r in test) == {lv: TEST_PER_LEVEL for lv in range(len(LEVELS))}
    assert Counter(r["level"] for r in train) == {0: 60, 1: 400, 2: 400, 3: 400, 4: 400}
    assert [r["level"] for r in test[:10]] == [0, 1, 2, 3, 4] * 2  # interleaved: any prefix is balanced
    for row in train + test:
        terms = [int(t) for t in row["prompt"].rstrip("=").split("+")]
        assert row["answer"] == str(sum(terms))
        lv = row["level"]
        assert (len(terms) == 3) == (lv == 3) and all(t < 10 for t in terms) == (lv in (0, 3))
        if lv in (1, 2):
            assert (terms[0] % 10 + terms[1] % 10 >= 10) == (lv == 2) and min(terms) >= 10
        if lv == 4:
            assert 100 <= terms[0] < 1000 and 10 <= terms[1] < 100
    assert task.rows("train", 50, 7) == task.rows("train", 50, 7) != task.rows("train", 50, 8)
    assert task.rows("test", 20, 1) == task.rows("test", 20, 2) and len(task.rows("train", 50, 7)) == 50
    with pytest.raises(ValueError, match="validation"):
        task.rows("validation", 5, 0)


# ====================================================================== end to end through the trainer
E2E = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval.size=0",
    "threads=1",
    "train.steps=3",
]


def _train(tmp_path, *overrides):
    from groupwise.build import build
    from groupwise.config import load_config
    from groupwise.trainer import Trainer

    cfg, _ = load_config(None, [*E2E, f'out="{tmp_path}"', *overrides])
    trainer = Trainer(build(cfg))
    summary = Run(trainer).train(resume_allow=["train.steps"])  # the resume test extends a finished 2-step run
    assert summary["steps"] == cfg.train.steps
    return trainer


def test_cgpo_end_to_end(tmp_path):
    trainer = _train(tmp_path, 'data.task="mixed"', 'sampling={name="cgpo", category_column="level", calib_every=2}')
    s = trainer.sampler
    assert len(s._hist) > 0, "observe was never called by the trainer"
    assert set(s._cat.values()) <= set(range(5)) and s._cat  # categories read from rollout.meta
    assert 0 < len(s._hist) <= 12  # 3 steps x 4 prompts
    never = sorted(set(range(s._table.numel())) - set(s._hist))
    assert s._table[never].eq(1.0).all()  # init 1 + 3/N, clipped to 1
    assert all(len(h) <= 3 for h in s._hist.values())


def test_fg_expo_end_to_end(tmp_path):
    trainer = _train(
        tmp_path,
        'data.task="mixed"',
        'sampling={name="gcs"}',
        'objective.terms=["ppo_clip", {name="kl", coef={schedule="akl", beta_max=0.08}}]',
    )
    assert bool(trainer.sampler._seen.any()), "observe was never called by the trainer"
    kl = trainer.objective.terms[1]
    akl = kl.schedules["coef"]
    assert akl._beta is not None, "the trainer never resolved the akl schedule"
    assert kl.coef == akl._beta and 0.0 <= kl.coef <= 0.08


@pytest.mark.parametrize(
    "overrides",
    [
        ['sampling={name="cgpo", category_column="level", calib_every=1}'],
        [
            'sampling={name="gcs"}',
            'objective.terms=["ppo_clip", {name="kl", coef={schedule="akl", beta_max=0.08, ema_decay=0.9}}]',
        ],
    ],
    ids=["cgpo", "fg_expo"],
)
def test_resume_through_the_trainer_is_exact(tmp_path, overrides):
    straight = _train(tmp_path / "straight", 'data.task="mixed"', "train.steps=4", *overrides)
    _train(tmp_path / "resumed", 'data.task="mixed"', "train.steps=2", "checkpoint.every=1", *overrides)
    again = _train(tmp_path / "resumed", 'data.task="mixed"', "train.steps=4", "checkpoint.every=1", *overrides)
    assert json.dumps(again.sampler.state_dict()) == json.dumps(straight.sampler.state_dict())
    rows = [
        [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("straight", "resumed")
    ]
    assert [r["reward_mean"] for r in rows[0]] == [r["reward_mean"] for r in rows[1]]
    coefs = [[r.get("coef/kl.coef") for r in run] for run in rows]
    assert coefs[0] == coefs[1]
