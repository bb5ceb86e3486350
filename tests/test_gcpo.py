"""GCPO (specs/35), worked by hand. v(S) = log det(I + Φ_S Φ_Sᵀ), φ_i = max(r_i, 0)·e_i::

spec: e1 = e2 = [1,0], e3 = [0,1], r = [1,1,1,0]
  v({1}) = ln 2, v({1,2}) = ln det[[2,1],[1,2]] = ln 3, v({1,3}) = ln 4, v({1,2,3}) = ln(3·2) = ln 6
  player 3 is orthogonal to 1, 2: every marginal contribution is ln 2  → ψ3 = ln 2
  players 1, 2 split v({1,2}) = ln 3 by symmetry                     → ψ1 = ψ2 = ln3/2 = 0.549306
  ψ = [.549306, .549306, .693147, 0], Σψ = ln 6 = 1.791759; mean .447940, population std .265204
  A = [.3822, .3822, .9246, −1.6890]
orthogonal players: v additive, ψ_i = ln(1 + q_i²): q = [1, .5] → [ln 2, ln 1.25]
mix = .5 on the spec: norm(r) = [.57735 ×3, −1.73205] → A = [.47978, .47978, .75098, −1.71053]
n-grams of "12+3" (^12 12+ 2+3 +3$) and "12+4" (^12 12+ 2+4 +4$): 2 of 4 shared → cosine 1/2
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import info_for, rollout_from, train_recorded

from groupwise.advantages.gcpo import dpp_logvol, gcpo_advantages, ngram_embeddings, shapley_values
from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.seeds import sample_seed
from groupwise.types import Need, StepInfo

E = torch.tensor([[1.0, 0], [1, 0], [0, 1], [0.3, 0.7]])  # [G,d] e4 anything: r4 = 0
R = torch.tensor([1.0, 1, 1, 0])
PSI = [math.log(3) / 2, math.log(3) / 2, math.log(2), 0.0]
SPEC_A = [0.3822, 0.3822, 0.9246, -1.6890]


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def _ro(texts, rewards, valid=None):
    r = torch.tensor(rewards, dtype=torch.float32)  # [B,G]
    ro = rollout_from(torch.zeros(*r.shape, 2), rewards=r, completions=texts)
    if valid is not None:
        ro.group_valid = torch.tensor(valid, dtype=torch.bool)
    return ro


def test_spec_values_and_shapley():
    phi = R[:, None] * E  # [G,d]
    for S, want in (
        ([0], math.log(2)),
        ([0, 1], math.log(3)),
        ([0, 2], math.log(4)),
        ([0, 1, 2], math.log(6)),
        ([], 0.0),
    ):
        assert float(dpp_logvol(phi[S])) == pytest.approx(want, abs=1e-12)
    psi = shapley_values(phi, exact=True)
    _close(psi, PSI, atol=1e-12)
    assert psi[0] == psi[1] and psi[3] == 0  # duplicates tie bit for bit; the wrong rollout is a null player
    assert float(psi.sum()) == pytest.approx(math.log(6), abs=1e-12)


def test_spec_advantages():
    adv, team = gcpo_advantages(E[None], R[None])
    _close(adv, [SPEC_A], atol=6e-5)
    assert float(team[0]) == pytest.approx(1.791759, abs=1e-6)
    assert adv[0, 2] > adv[0, 0]  # the unique correct solution outranks the two duplicates


def test_orthogonal_players_and_clipped_rewards():
    phi = torch.tensor([[1.0, 0, 0], [0, 0.5, 0], [0, 0, 0]])
    _close(shapley_values(phi), [math.log(2), math.log(1.25), 0.0], atol=1e-12)
    # graded rewards: q = max(r, 0); a negative reward is a null player like a wrong one
    adv, _ = gcpo_advantages(torch.eye(3)[None], torch.tensor([[1.0, 0.5, -0.5]]))
    # ψ = [.693147, .223144, 0], mean .305430, population std .288897 → A = [1.34206, −.28483, −1.05723]
    _close(adv, [[1.34206, -0.28483, -1.05723]], atol=1e-5)


def test_monte_carlo_within_002_of_exact_and_seeded():
    _close(shapley_values(R[:, None] * E, exact=False, n_perm=2000, seed=5), PSI, atol=0.02)
    phi = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))  # [G,d] a non-trivial game
    exact = shapley_values(phi, exact=True)
    mc = shapley_values(phi, exact=False, n_perm=2000, seed=1)
    assert (mc - exact).abs().max() < 0.02 and not torch.equal(mc, exact)
    assert torch.equal(mc, shapley_values(phi, exact=False, n_perm=2000, seed=1))
    assert not torch.equal(mc, shapley_values(phi, exact=False, n_perm=2000, seed=2))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_efficiency_on_random_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    phi = torch.randn(9, 4, generator=g) * (torch.rand(9, 1, generator=g) > 0.3)  # [G,d] some null players
    v = float(dpp_logvol(phi))
    assert float(shapley_values(phi, exact=True).sum()) == pytest.approx(v, abs=1e-10)
    assert float(shapley_values(phi, exact=False, n_perm=64, seed=seed).sum()) == pytest.approx(v, abs=1e-10)
    assert (shapley_values(phi)[(phi == 0).all(1)] == 0).all()


def test_auto_is_exact_over_non_null_players_only():
    g = torch.Generator().manual_seed(3)
    phi = torch.cat([torch.randn(4, 3, generator=g), torch.zeros(16, 3)])  # [20,d] 4 correct of 20
    torch.testing.assert_close(shapley_values(phi), shapley_values(phi, exact=True))
    full = torch.randn(17, 3, generator=g)  # 17 non-null > exact_max = 16: Monte-Carlo
    torch.testing.assert_close(shapley_values(full, seed=4), shapley_values(full, exact=False, seed=4))


def test_ngram_embeddings():
    e = ngram_embeddings(["12+3", "12+4", " 12+3 ", "", "3+12"])
    assert float(e[0] @ e[1]) == pytest.approx(0.5) and torch.equal(e[0], e[2])
    assert (e[3] == 0).all() and float(e[0] @ e[4]) == 0.0 and float(e[0].norm()) == pytest.approx(1.0)


def test_component_on_texts_reproduces_the_spec():
    est = build("advantage", "gcpo")
    ro = _ro([["12+3", "12+3", "3+12", "9+9"]], [[1, 1, 1, 0]])  # "3+12" shares no trigram with "12+3"
    _close(est(ro, info_for(2)), [SPEC_A], atol=6e-5)
    assert est.step_stats() == pytest.approx({"gcpo/team_value": math.log(6), "gcpo/distinct_correct": 2.0})
    mixed = build("advantage", "gcpo", mix=0.5)(ro, info_for(2))
    _close(mixed, [[0.47978, 0.47978, 0.75098, -1.71053]], atol=1e-4)
    grpo = build("advantage", "grpo", std="population", eps=1e-6)(ro, info_for(2))
    torch.testing.assert_close(build("advantage", "gcpo", mix=0.0)(ro, info_for(2)), grpo)


def test_edge_cases_are_exact_zero():
    nan = float("nan")
    ro = _ro(
        [
            ["5+5", "5+5", "5+5", "5+5"],  # all correct, identical: constant ψ
            ["1+9", "2+8", "x", "3+7"],  # one valid row
            ["1+9", "2+8", "3+7", "0+9"],  # NaN reward and an invalid row
            ["1", "2", "3", "4"],
        ],  # all wrong
        [[1, 1, 1, 1], [1, 0, 1, 1], [1, nan, 0, 1], [0, 0, 0, 0]],
        valid=[[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],
    )
    est = build("advantage", "gcpo")
    adv = est(ro, info_for(2))
    assert (adv[0] == 0).all() and (adv[1] == 0).all() and (adv[3] == 0).all()
    assert adv[2, 1] == 0 and adv[2, 3] == 0
    # group 2: valid rows "1+9" (correct), "3+7" (wrong, null): ψ = [ln 2, 0] → ±1 (population std ln2/2)
    half = math.log(2) / 2
    _close(adv[2, [0, 2]], [half / (half + 1e-6), -half / (half + 1e-6)], atol=1e-7)
    # distinct correct texts per group with a valid row: 1, 1, 1, 0
    assert est.step_stats()["gcpo/distinct_correct"] == pytest.approx(3 / 4)


def test_hidden_embedding_mean_over_completion_tokens():
    est = build("advantage", "gcpo", embedding="hidden", layer=2)
    assert est.needs == (Need("hidden(2)", model="ref"),)
    ro = _ro([["a", "b", "c", "d"]], [[1, 1, 1, 0]])
    ro.mask = torch.tensor([[[True, True], [True, False], [True, True], [True, True]]])
    # [1,4,2,2]; masked token: garbage
    hidden = torch.tensor([[[[2.0, 0], [0, 0]], [[3, 0], [99, 99]], [[0, 1], [0, 3]], [[5, 5], [5, 5]]]])
    ro.set_extra(Need("hidden(2)", model="ref").key, hidden, "token")
    _close(est(ro, info_for(2)), [SPEC_A], atol=6e-5)  # means [1,0], [3,0], [0,2] → directions e1, e1, e2
    with pytest.raises(ValueError, match="hidden"):
        build("advantage", "gcpo", embedding="hidden")(ro, info_for(2))  # layer 4 was not filled


def test_seeded_by_run_step_and_prompt():
    texts = [[f"{a}+{12 - a}" for a in range(12)]]  # 12 distinct correct, Monte-Carlo forced
    ro = _ro(texts, [[1.0] * 12])
    est = build("advantage", "gcpo", n_perm=8, shapley="mc")
    a = est(ro, StepInfo(step=3, seed=1, max_new_tokens=2))
    assert torch.equal(a, est(ro, StepInfo(step=3, seed=1, max_new_tokens=2)))
    assert not torch.equal(a, est(ro, StepInfo(step=4, seed=1, max_new_tokens=2)))
    emb = ngram_embeddings(texts[0])[None]
    want, _ = gcpo_advantages(emb, ro.rewards, exact=False, n_perm=8, seeds=[sample_seed(1, 3, 0, 0)])
    torch.testing.assert_close(a, want.float())


def test_errors():
    for kw, match in (
        ({"embedding": "bert"}, "embedding"),
        ({"shapley": "fast"}, "shapley"),
        ({"mix": 1.5}, "mix"),
        ({"n_perm": 0}, "n_perm"),
        ({"exact_max": 20}, "exact_max"),
        ({"std": "iqr"}, "std"),
    ):
        with pytest.raises(ConfigError, match=match):
            build("advantage", "gcpo", **kw)


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_two_steps_on_the_embedded_model(tmp_path, objective):
    rows, seen = train_recorded(
        tmp_path, objective, 'advantage.estimator="gcpo"', "rollout.group_size=8", "rollout.prompts_per_step=8"
    )
    for row, batch in zip(rows, seen):
        valid = batch.group_valid & torch.isfinite(batch.rewards)
        seeds = [sample_seed(0, row["step"], int(p), b) for b, p in enumerate(batch.prompt_index.tolist())]
        emb = ngram_embeddings([t for group in batch.completions for t in group]).reshape(*batch.rewards.shape, -1)
        want, _ = gcpo_advantages(emb, batch.rewards, valid, seeds=seeds)
        torch.testing.assert_close(batch.advantages, want.float())  # GCPO's, from the decoded texts
        correct = valid & (batch.rewards > 0)
        mixed = correct.any(1) & (valid & ~correct).any(1)
        assert mixed.any()
        for b in mixed.nonzero().flatten().tolist():  # one answer per prompt: every correct row above every wrong row
            assert batch.advantages[b][correct[b]].min() > batch.advantages[b][valid[b] & ~correct[b]].max()
        assert row["gcpo/distinct_correct"] <= 1.0  # the demo task has a single correct text


def test_hidden_embedding_through_the_trainer(tmp_path):
    rows, seen = train_recorded(
        tmp_path,
        "ppo_clip",
        'advantage.estimator={name="gcpo", embedding="hidden", layer=4}',
        "rollout.group_size=8",
        "rollout.prompts_per_step=4",
        steps=1,
    )
    key = Need("hidden(4)", model="ref").key
    assert seen[0].extras[key].shape[-1] == 128 and torch.isfinite(seen[0].advantages).all()


def test_huge_rewards_keep_the_log_volume_finite_and_exact():
    """Rewards near 3e38: I + K rounds to a singular matrix (1 + a² == a²), where Cholesky fails; the
    eigenvalue fallback gives log det(I + K) = log(1 + 2a²) for two equal players, split in half."""
    a = 1e38
    phi = torch.tensor([[a], [a]], dtype=torch.float64)  # [2,1]
    want = math.log(2.0) + 2 * math.log(a)
    assert float(dpp_logvol(phi)) == pytest.approx(want, rel=1e-12)
    for exact in (True, False):
        psi = shapley_values(phi, exact=exact, n_perm=8)
        torch.testing.assert_close(psi, torch.full((2,), want / 2, dtype=torch.float64), rtol=1e-12, atol=0.0)


# ------------------------------------------------------------------------------------------ exact shares up to G = 16
def _brute_force_shapley(phi):
    """ψ from the definition: v(S) = log det(I + Φ_S Φ_Sᵀ) by slogdet (LU) for every subset, then
    ψ_i = Σ_{S ∌ i} |S|!(n − |S| − 1)!/n! · (v(S ∪ i) − v(S)). No Cholesky, no growing, no batching."""
    import itertools

    n = phi.shape[0]
    K = phi.double() @ phi.double().T  # [n,n]
    v = {}
    for size in range(n + 1):
        for S in itertools.combinations(range(n), size):
            idx = list(S)
            v[S] = float(torch.linalg.slogdet(torch.eye(size, dtype=torch.float64) + K[idx][:, idx])[1]) if S else 0.0
    psi = [0.0] * n
    for S, value in v.items():
        w = math.factorial(len(S)) * math.factorial(n - len(S) - 1) / math.factorial(n) if len(S) < n else 0.0
        for i in set(range(n)) - set(S):
            psi[i] += w * (v[tuple(sorted(S + (i,)))] - value)
    return torch.tensor(psi, dtype=torch.float64)


def _graded_players(n, seed):
    """[n,3] unit directions in 3-d scaled by q in (0, 3): a game where 256 orders err by ~0.1."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, 3, generator=g, dtype=torch.float64)  # [n,3]
    return e / e.norm(dim=1, keepdim=True) * 3 * torch.rand(n, 1, generator=g, dtype=torch.float64)  # [n,3]


@pytest.mark.parametrize("n", [11, 12])
def test_auto_share_is_exact_against_brute_force(n):
    # Before: more than exact_max = 10 correct rows took 256 Monte-Carlo orders (here off by > 0.01).
    phi = _graded_players(n, seed=n)
    want = _brute_force_shapley(phi)
    got = shapley_values(phi)  # the component's default: auto, exact_max = 16
    mc = shapley_values(phi, exact=False, n_perm=256, seed=0)
    print(
        f"GCPO Shapley G={n}: max |auto − brute force| {(got - want).abs().max():.2e}, "
        f"256-order Monte-Carlo {(mc - want).abs().max():.3f}"
    )
    assert (got - want).abs().max() < 1e-9
    assert (mc - want).abs().max() > 0.01  # what the limit of 10 left to chance


def test_sixteen_players_exact_against_the_batched_factorisation():
    # At G = 16 the grown subsets (Schur-complement pivots) against all 2^16 subsets factorised at once
    # (the other algorithm of dpp_shapley, by Cholesky), plus the axioms: efficiency, symmetry, null player.
    from groupwise.advantages.dpp_shapley import _subset_values_batched, _subset_values_grown, _subsets

    phi = _graded_players(16, seed=16)
    phi[5] = phi[2]  # two identical players
    K = phi @ phi.T  # [16,16]
    grown, batched = _subset_values_grown(K), _subset_values_batched(K)  # [2^16] each
    assert grown is not None and (grown - batched).abs().max() < 1e-10
    _, with_i, weight = _subsets(16)
    want = (weight * (batched[with_i] - batched[:, None])).sum(0)  # [16]
    got = shapley_values(phi)  # auto at 16: exact
    print(f"GCPO Shapley G=16: max |auto − batched Cholesky| {(got - want).abs().max():.2e}")
    assert (got - want).abs().max() < 1e-9
    assert float(got.sum()) == pytest.approx(float(dpp_logvol(phi)), abs=1e-9) and got[2] == got[5]
    with_null = shapley_values(torch.cat([phi[:15], torch.zeros(1, 3, dtype=torch.float64)]))  # 15 players + a null one
    assert with_null[15] == 0.0


def test_grown_subsets_fall_back_on_rounded_pivots():
    # 11 equal players with rewards 1e38: 1 + a² rounds to a², so the second pivot is 0 or rounding noise;
    # the grown path gives up and the game goes to the batched factorisation (finite, efficient, tied).
    from groupwise.advantages.dpp_shapley import _subset_values_batched, _subset_values_grown

    phi = torch.full((11, 1), 1e38, dtype=torch.float64)  # [11,1]
    assert _subset_values_grown(phi @ phi.T) is None
    psi = shapley_values(phi)  # [11]
    assert torch.isfinite(psi).all() and (psi == psi[0]).all()
    assert float(psi.sum()) == pytest.approx(float(_subset_values_batched(phi @ phi.T)[-1]), rel=1e-12)
    ok = torch.full((11, 1), 1e3, dtype=torch.float64)  # rewards 1e3: pivots keep their digits, the grown path runs
    assert _subset_values_grown(ok @ ok.T) is not None


def test_quality_shift_by_hand():
    # orthogonal players, rewards (1, 0.5, −0.5): shift → q = r − (−0.5) = (1.5, 1, 0),
    # ψ = ln(1 + q²) = (1.178655, 0.693147, 0)
    # mean 0.623934, population std 0.483666 → A = (1.146906, 0.143101, −1.290007); clip: q = (1, .5, 0), A as above
    adv, _ = gcpo_advantages(torch.eye(3)[None], torch.tensor([[1.0, 0.5, -0.5]]), quality="shift")
    _close(adv, [[1.146906, 0.143101, -1.290007]], atol=1e-5)
    est = build("advantage", "gcpo", quality="shift")
    ro = _ro([["1+9", "1+9", "3+7", "x"]], [[2.0, 2.0, 2.0, 2.0]])  # all equal rewards: all null under shift
    assert (est(ro, info_for(2)) == 0).all()
    assert not (build("advantage", "gcpo")(ro, info_for(2)) == 0).all()  # clip: the duplicates share less credit
    with pytest.raises(ConfigError, match="quality"):
        build("advantage", "gcpo", quality="abs")
