"""pass_at_k advantages worked by hand (Chen et al. 2025 eqs. 11–15; PKPO eq. 33), checked against a
brute-force enumeration of all k-subsets, the k = 1 reductions to grpo / rloo, ragged groups, k > N
and bad configuration. Unless stated, eps = 0 so the hand numbers are exact."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from helpers import info_for, rollout_from

from groupwise.advantages.pass_at_k import chen_pair, pkpo_pair
from groupwise.errors import ConfigError
from groupwise.registry import build, build_spec
from groupwise.run import Run

NAN = float("nan")


def _ro(rewards, valid=None):
    r = torch.tensor(rewards, dtype=torch.float32)
    B, G = r.shape
    ro = rollout_from(torch.zeros(B, G, 2), None, rewards=r)
    if valid is not None:
        ro.group_valid = torch.tensor(valid, dtype=torch.bool)
    return ro


def _adv(rewards, valid=None, name="pass_at_k", **params):
    return build("advantage", name, **params)(_ro(rewards, valid), info_for(2))


def _brute_chen(f, k):
    """Chen et al.'s bootstrap over ALL k-subsets: subset reward max(f_I); GRPO-normalise the subset
    rewards (population std); a row's advantage is the mean over the subsets holding it."""
    subsets = list(itertools.combinations(range(len(f)), k))
    R = [max(f[i] for i in s) for s in subsets]
    mean = sum(R) / len(R)
    sd = math.sqrt(sum((x - mean) ** 2 for x in R) / len(R))
    if sd == 0:
        return [0.0] * len(f)
    return [
        sum((x - mean) / sd for x, s in zip(R, subsets) if i in s) / math.comb(len(f) - 1, k - 1) for i in range(len(f))
    ]


def _brute_pkpo(f, k):
    """PKPO eq. 33 literally: (1/C(n,k)) Σ_{|I|=k, i∈I} (max_I f − max_{I∖i} f)."""
    n = len(f)
    out = []
    for i in range(n):
        total = sum(
            max(f[j] for j in s) - max(f[j] for j in s if j != i) for s in itertools.combinations(range(n), k) if i in s
        )
        out.append(total / math.comb(n, k))
    return out


# ---------------------------------------------------------------------------------------------- chen
def test_chen_by_hand():
    # N=4, c=1, k=2: C(3,2)/C(4,2) = 3/6 → R̄ = 0.5, σ = √(0.5·0.5) = 0.5
    #   correct (1 − 0.5)/0.5 = 1.0;  wrong (1 − 0.5 − C(2,1)/C(3,1) = 2/3)/0.5 = −1/6/0.5 = −1/3
    # N=4, c=2, k=2: C(2,2)/C(4,2) = 1/6 → R̄ = 5/6, σ = √(5/36) = √5/6
    #   correct (1/6)/(√5/6) = 1/√5 = 0.44721;  wrong (1/6 − C(1,1)/C(3,1) = 1/3)/(√5/6) = −1/√5
    adv = _adv([[1, 0, 0, 0], [0, 1, 1, 0]], k=2, eps=0.0)
    s5 = 1 / math.sqrt(5)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3], [-s5, s5, s5, -s5]]))
    assert adv.dtype == torch.float32


def test_chen_n8_k4_and_reference_eps():
    # N=8, c=2, k=4: C(6,4)/C(8,4) = 15/70 = 3/14 → R̄ = 11/14, σ = √(11·3)/14 = 0.410326
    #   correct (3/14)/σ = 0.522233;  wrong (3/14 − C(5,3)/C(7,3) = 10/35)/σ = (−1/14)/σ = −0.174078
    sigma = math.sqrt(33) / 14
    assert chen_pair(8, 2, 4, 0.0) == pytest.approx((3 / 14 / sigma, -1 / 14 / sigma), rel=1e-12)
    # the default eps = 1e-6 (calc_adv's sigma + 1e-6) divides by σ + 1e-6 instead
    adv = _adv([[1, 1, 0, 0, 0, 0, 0, 0]])  # defaults: k = 4, eps = 1e-6
    torch.testing.assert_close(adv[0, :2], torch.full((2,), 3 / 14 / (sigma + 1e-6)))
    torch.testing.assert_close(adv[0, 2:], torch.full((6,), -1 / 14 / (sigma + 1e-6)))


@pytest.mark.parametrize("n", [2, 3, 5, 6])
def test_chen_equals_brute_force_subsets_and_sums_to_zero(n):
    # every (c, k): the closed form is the exact all-subsets bootstrap; Σ_group adv = 0 (Note 2)
    for c in range(n + 1):
        for k in range(1, n + 1):
            f = [1] * c + [0] * (n - c)
            pos, neg = chen_pair(n, c, k, 0.0)
            want = _brute_chen(f, k)
            assert [pos] * c + [neg] * (n - c) == pytest.approx(want, abs=1e-12), (n, c, k)
            assert c * pos + (n - c) * neg == pytest.approx(0.0, abs=1e-12), (n, c, k)


def test_chen_k1_is_population_std_grpo_not_default_grpo():
    # k=1: R̄ = c/N = 0.25, σ = √(0.25·0.75) = 0.4330127 (population std)
    #   correct 0.75/0.4330127 = √3 = 1.7320508;  wrong (1 − 0.25 − C(2,0)/C(3,0) = 1)/σ = −1/√3
    rewards = [[1, 0, 0, 0], [1, 1, 0, 1]]
    adv = _adv(rewards, k=1, eps=0.0)
    torch.testing.assert_close(
        adv[0], torch.tensor([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)])
    )
    for eps in (0.0, 1e-6):
        torch.testing.assert_close(
            _adv(rewards, k=1, eps=eps), _adv(rewards, name="grpo", std="population", eps=eps), rtol=1e-6, atol=1e-7
        )
    # the default grpo uses the Bessel std (√(0.75/3) = 0.5) and eps 1e-4: 0.75/0.5001 = 1.49970
    default = _adv(rewards, name="grpo")
    assert default[0, 0].item() == pytest.approx(1.49970, abs=1e-5)
    assert not torch.allclose(_adv(rewards, k=1), default, atol=1e-2)


def test_chen_easy_group_wrong_rows_get_zero():
    # N=4, c=3, k=2: N − c = 1 < k → every pair holds a correct row, R̄ = 1, σ = 0 → all 0 (Note 3)
    assert (_adv([[1, 1, 1, 0]], k=2) == 0).all()


# ---------------------------------------------------------------------------------------------- pkpo
def test_pkpo_by_hand():
    # N=4, c=1, k=2: correct C(3,1)/C(4,2) = 3/6 = 0.5, wrong 0. PKPO eq. 8 (no baseline) would give the
    #   correct row k/n = 0.5 and the wrong ones (k/n)·ρ(3,1,1) = 0.5·1/3; the pass@1 baseline removes exactly those
    # N=4, c=2, k=2: correct C(2,1)/C(4,2) = 2/6 = 1/3
    # N=8, c=2, k=4: correct C(6,3)/C(8,4) = 20/70 = 2/7
    adv = _adv([[1, 0, 0, 0], [0, 1, 1, 0]], k=2, form="pkpo")
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0, 0, 0], [0, 1 / 3, 1 / 3, 0]]))
    assert pkpo_pair(8, 2, 4) == pytest.approx((2 / 7, 0.0), rel=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5, 6])
def test_pkpo_equals_eq33_by_enumeration_and_its_group_sum(n):
    # Σ_group adv = k·(ρ(N,c,k) − ρ(N,c,k−1)), ρ(n,c,k) = 1 − C(n−c,k)/C(n,k) (Note 2); e.g. N=4,c=1,k=2:
    # 2·(0.5 − 0.25) = 0.5 = the lone correct row's 0.5
    rho = lambda c, k: 1 - math.comb(n - c, k) / math.comb(n, k)  # noqa: E731
    for c in range(n + 1):
        for k in range(2, n + 1):
            f = [1] * c + [0] * (n - c)
            pos, neg = pkpo_pair(n, c, k)
            assert [pos] * c + [neg] * (n - c) == pytest.approx(_brute_pkpo(f, k), abs=1e-12), (n, c, k)
            assert c * pos + (n - c) * neg == pytest.approx(k * (rho(c, k) - rho(c, k - 1)), abs=1e-12), (n, c, k)


def test_pkpo_k1_is_rloo():
    # k=1 uses PKPO's eq. 26: r − mean of the others. [1,0,0,0]: 1 − 0 = 1, 0 − 1/3 = −1/3
    rewards = [[1, 0, 0, 0], [1, 1, 0, 1]]
    adv = _adv(rewards, k=1, form="pkpo")
    torch.testing.assert_close(adv[0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    torch.testing.assert_close(adv, _adv(rewards, name="rloo"))


# ---------------------------------------------------------------------------------------------- groups
@pytest.mark.parametrize("form", ["chen", "pkpo"])
def test_ragged_group_uses_its_own_valid_count(form):
    # row 4 invalid and row 5 NaN: N = 4, c = 1 → the hand example (chen 1, −1/3; pkpo 0.5, 0); excluded rows 0
    adv = _adv([[1, 0, 0, 0, 1, NAN]], [[1, 1, 1, 1, 0, 1]], k=2, form=form, eps=0.0)
    want = [1.0, -1 / 3, -1 / 3, -1 / 3] if form == "chen" else [0.5, 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor([want + [0.0, 0.0]]))


def test_k_larger_than_group_is_clamped():
    # N = 3 valid, k = 4 → k' = 3 = N. chen: every 3-subset is the whole group, R̄ = 1 → 0.
    # pkpo: lone correct row C(2,2)/C(3,3) = 1; two correct rows C(1,2)/C(3,3) = 0
    rewards, valid = [[1, 0, 0, 0], [1, 1, 0, 0]], [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert (_adv(rewards, valid, k=4) == 0).all()
    torch.testing.assert_close(_adv(rewards, valid, k=4, form="pkpo"), torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]]))


@pytest.mark.parametrize("form", ["chen", "pkpo"])
def test_degenerate_groups_are_exactly_zero(form):
    # all correct, all wrong, one valid row, no valid row: 0 everywhere (σ = 0 / nothing to compare)
    adv = _adv(
        [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0]],
        [[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]],
        k=2,
        form=form,
        eps=0.0,
    )
    assert (adv == 0).all()


def test_correct_at_threshold():
    # rewards [0.7, 0.2, 0.2, 0.2]: at correct_at = 1.0 nothing is correct → 0; at 0.5 row 0 is → (1, −1/3, ...)
    assert (_adv([[0.7, 0.2, 0.2, 0.2]], k=2) == 0).all()
    torch.testing.assert_close(
        _adv([[0.7, 0.2, 0.2, 0.2]], k=2, correct_at=0.5, eps=0.0), torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]])
    )


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "params", [{"k": 0}, {"k": -2}, {"k": 2.5}, {"k": True}, {"form": "loo"}, {"eps": -1.0}, {"correct_at": NAN}]
)
def test_bad_parameters_are_config_errors(params):
    from groupwise.advantages.pass_at_k import PassAtKAdvantage

    with pytest.raises(ConfigError, match="pass_at_k"):
        PassAtKAdvantage(**params)


def test_builds_from_a_config_table():
    est = build_spec("advantage", {"name": "pass_at_k", "k": 2, "form": "pkpo"})
    assert (est.k, est.form, est.group_relative) == (2, "pkpo", True)


@pytest.mark.slow
def test_trains_end_to_end(tmp_path):
    from test_trainer import make_trainer

    trainer = make_trainer(tmp_path, 'advantage.estimator={name="pass_at_k", k=2}', "train.steps=2", "eval.size=0")
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
