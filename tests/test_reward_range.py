"""Rewards across float32's whole range (issue #12 item 10): advantages stay finite and right,
and a weighted total that overflows float32 is excluded and counted.

The group statistics are float64 (``groupwise.masked``); in float32 (x − mean)² overflows once |r|
passes ~1.8e19 and a group's sum once it passes 3.4e38. Expected values are worked by hand with
a = float32(3e38); terms of relative size 1e20/a ≈ 3e-19 are below any tolerance used here.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fill_inputs, info_for, make_rollout, rollout_from

from groupwise.registry import build, names
from groupwise.rewards.score import combine, score
from groupwise.rewards.stage import RewardStage

A = float(torch.tensor(3e38))  # the float32 value nearest 3e38
E20 = float(torch.tensor(1e20))
F32_MAX = float(torch.finfo(torch.float32).max)
HUGE = [[1e20, -1e20, 3e38, 0.0], [3e38, 3e38, 3e38, -3e38], [3e38, -3e38, 1.0, 0.0], [1e20, -1e20, 0.0, 0.0]]


def _ro(rewards, T=1):
    r = torch.tensor(rewards, dtype=torch.float32)
    B, G = r.shape
    return rollout_from(torch.zeros(B, G, T), None, rewards=r)


def _adv(name, rewards, **params):
    return build("advantage", name, **params)(_ro(rewards), info_for(1))


def close(got, want, rel=1e-6):
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=rel, atol=0.0)


# ---------------------------------------------------------------------------------------------- every estimator
def _every_advantage(rewards, T=3):
    """(label, advantages) of every registered estimator, and of each shaper after grpo and dr_grpo."""
    for name in names("advantage"):
        comp = build("advantage", name)
        ro = make_rollout(B=len(rewards), G=len(rewards[0]), T=T, awkward=False)
        ro.rewards = torch.tensor(rewards, dtype=torch.float32)
        for key in getattr(comp, "rollout_extras", ()):  # ReMax's greedy baseline: the group's first reward
            ro.set_extra(key, ro.rewards[:, 0].clone(), "group")
        if getattr(comp, "shaper", False):
            for upstream in ("grpo", "dr_grpo"):  # dr_grpo hands on unscaled, huge advantages
                ro.advantages = build("advantage", upstream)(ro, info_for(T))
                fill_inputs(ro, comp)
                yield f"{upstream}+{name}", comp(ro, info_for(T))
        else:
            fill_inputs(ro, comp)  # needs, artifacts, vocabulary (F-GRPO's phase map)
            yield name, comp(ro, info_for(T))


def test_every_estimator_and_shaper_finite_float32_near_float32_max():
    # Before the float64 statistics: grpo NaN (group sum 4a → inf),
    # rloo/dr_grpo −inf, sign +inf, gear after dr_grpo +inf.
    out = dict(_every_advantage(HUGE))
    for label, adv in out.items():
        assert adv.dtype == torch.float32, label
        assert torch.isfinite(adv).all(), f"{label}: {adv}"
    assert {"grpo", "dr_grpo", "rloo", "sign", "gpg", "opo", "grpo+gear", "dr_grpo+gear"} <= set(out)
    for up in ("grpo", "dr_grpo"):  # gear's w > 0 on every (unmasked) token: A·w keeps A's sign, saturated or not
        shaped, seq = out[f"{up}+gear"], out[up][..., None].expand_as(out[f"{up}+gear"])
        assert torch.equal(shaped.sign(), torch.where(shaped == 0, 0.0, seq.sign())), up


# ---------------------------------------------------------------------------------------------- hand values
def test_grpo_huge_rewards_by_hand():
    # [1e20, −1e20]: mean 0, unbiased var = 2·1e40 / 1 → std √2·1e20; A = ±1e20/(√2·1e20 + 1e-4) = ±1/√2
    close(_adv("grpo", [[1e20, -1e20]]), [[1 / math.sqrt(2), -1 / math.sqrt(2)]])
    # [1e20, −1e20, a, 0]: mean a/4; devs ≈ (−a/4, −a/4, 3a/4, −a/4); Σdev² = 3a²/16 + 9a²/16 = 3a²/4
    #   unbiased: var a²/4, std a/2 → A = (−½, −½, 3/2, −½);  population: std √3·a/4 → A = (−1/√3, …, √3, …)
    close(_adv("grpo", [HUGE[0]]), [[-0.5, -0.5, 1.5, -0.5]])
    s3 = 1 / math.sqrt(3)
    close(_adv("grpo", [HUGE[0]], std="population"), [[-s3, -s3, math.sqrt(3), -s3]])
    # [a, a, a, −a]: mean a/2; devs (a/2, a/2, a/2, −3a/2); Σdev² = 3a²/4 + 9a²/4 = 3a²; var 3a²/3 → std a
    close(_adv("grpo", [HUGE[1]]), [[0.5, 0.5, 0.5, -1.5]])


def test_grpo_batch_std_huge_rewards_by_hand():
    # rows HUGE[0], HUGE[1]: all 8 rewards sum to 3a (the ±1e20 cancel) → mean 3a/8
    # devs from 3a/8 in units of a/8: (−3, −3, 5, −3, 5, 5, 5, −11); Σ = (9+9+25+9+75+121)·a²/64 = 248a²/64
    # unbiased var = 248a²/(64·7) → std = a·√(248/448); group-centred values / std:
    s = math.sqrt(248 / 448)
    adv = _adv("grpo", HUGE[:2], scale="batch")
    close(adv, [[-0.25 / s, -0.25 / s, 0.75 / s, -0.25 / s], [0.5 / s, 0.5 / s, 0.5 / s, -1.5 / s]])


def test_unscaled_estimators_saturate_at_float32_max():
    # dr_grpo [a,a,a,−a]: r − a/2 = (a/2, a/2, a/2, −3a/2); −3a/2 = −4.5e38 does not fit float32 → −F32_MAX
    close(_adv("dr_grpo", [HUGE[1]]), [[A / 2, A / 2, A / 2, -F32_MAX]])
    # rloo = n/(n−1)·(r − mean) = 4/3·(…) = (2a/3, 2a/3, 2a/3, −2a → −F32_MAX)
    close(_adv("rloo", [HUGE[1]]), [[2 * A / 3, 2 * A / 3, 2 * A / 3, -F32_MAX]])
    # sign 2r − 1: ±6e38 → ±F32_MAX; 2·1e20 − 1 = 2e20
    close(_adv("sign", [HUGE[1], HUGE[3]]), [[F32_MAX, F32_MAX, F32_MAX, -F32_MAX], [2 * E20, -2 * E20, -1.0, -1.0]])
    # gpg [1e20, −1e20]: N = M = 2 → α = 1; A = r − 0 = ±1e20
    close(_adv("gpg", [[1e20, -1e20]]), [[E20, -E20]])
    # opo [1e20, −1e20], equal lengths: baseline (1e20 − 1e20)/2 = 0 → ±1e20
    close(_adv("opo", [[1e20, -1e20]]), [[E20, -E20]])
    # [a,a,a,−a]: gpg α = 4/4 = 1 and opo's equal-length baseline = mean = a/2: both r − a/2, −3a/2 saturating
    for name in ("gpg", "opo"):
        close(_adv(name, [HUGE[1]]), [[A / 2, A / 2, A / 2, -F32_MAX]])


def test_reinforce_pp_huge_rewards_by_hand():
    # one token per row, returns ±a: mean 0, unbiased var 2a²/1 → A = ±a/(√2·a) = ±1/√2 (eps 1e-8 negligible)
    close(_adv("reinforce_pp", [[3e38, -3e38]])[..., 0], [[1 / math.sqrt(2), -1 / math.sqrt(2)]])


# ---------------------------------------------------------------------------------------------- ordinary rewards
def _float32_grpo(r: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """The pre-float64 formula, all in float32: (r − mean)/(std_unbiased + eps), constant groups 0."""
    centred = r - r.mean(1, keepdim=True)
    adv = centred / (r.std(1, keepdim=True) + eps)
    return torch.where((r == r[:, :1]).all(1, keepdim=True), torch.zeros(()), adv)


def _float64_grpo(r: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    r = r.double()
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    return torch.where((r == r[:, :1]).all(1, keepdim=True), torch.zeros((), dtype=torch.float64), adv)


@pytest.mark.parametrize("G", [2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("kind", ["binary", "uniform"])
def test_grpo_ordinary_rewards_match_float32_formula(G, kind):
    gen = torch.Generator().manual_seed(G)
    r = (
        torch.randint(0, 2, (2000, G), generator=gen).float()
        if kind == "binary"
        else torch.rand(2000, G, generator=gen)
    )
    adv = build("advantage", "grpo")(_ro(r.tolist()), info_for(1))
    # within float32 rounding of the old all-float32 formula (the default path does not move). That
    # formula's own error grows like 1e-7/std (cancellation), so uniform groups are compared where
    # std >= 0.1; every non-constant binary group of G <= 16 has std >= √(15/256) ≈ 0.24.
    well_spread = r.std(1) >= 0.1  # [B]
    torch.testing.assert_close(adv[well_spread], _float32_grpo(r)[well_spread], rtol=0.0, atol=1e-6)
    # and correctly rounded everywhere: within half a float32 ulp (2^-24 relative) of the float64 formula
    torch.testing.assert_close(adv.double(), _float64_grpo(r), rtol=2.0**-24, atol=1e-30)


def test_grpo_close_rewards_cancellation_is_gone():
    # r = (x, x − δ) with δ ≪ |x|: A = ±δ/2 / (δ/√2 + 1e-4). In float32 the centring and the std lose digits
    # (the old path was off by ~1e-5 on such a pair); float64 gives the value to float32 rounding.
    x, y = -1.1639312505722046, -1.175161600112915  # both float32 values
    d = x - y
    want = (d / 2) / (d / math.sqrt(2) + 1e-4)
    close(_adv("grpo", [[x, y]]), [[want, -want]], rel=2.0**-23)


# ---------------------------------------------------------------------------------------------- overflowing totals
def test_combine_excludes_a_total_beyond_float32():
    # float64 sums: 2a = 6e38 and −2a overflow float32 (→ ±inf before); a + 0.1a = 3.3e38 still fits; 1 + 2 = 3
    parts = torch.tensor([[A, A], [-A, -A], [A, 0.1 * A], [1.0, 2.0]], dtype=torch.float64)
    for missing in ("exclude", "zero"):
        total, excluded = combine(parts, [1.0, 1.0], torch.zeros(4, dtype=torch.bool), missing)
        assert excluded.tolist() == [True, True, False, False], missing
        assert total[:2].isnan().all() and total[2] == torch.tensor(1.1 * A, dtype=torch.float32) and total[3] == 3.0
    # a weight can push a fitting reward out of range: 3 · a = 9e38
    total, excluded = combine(torch.tensor([[A]], dtype=torch.float64), [3.0], torch.zeros(1, dtype=torch.bool))
    assert excluded.tolist() == [True] and total.isnan().all()


def _const(values, name):
    def fn(prompts, completions, **kwargs):
        return values

    fn.__qualname__, fn.__module__ = name, "tests"
    return fn


def test_score_counts_overflowing_totals_as_excluded():
    big = _const([3e38, 3e38, 1.0], "big")
    res = score([big, big], ["p"] * 3, ["a", "b", "c"], {})
    # row 0, 1: 3e38 + 3e38 = 6e38 > float32 max → excluded, NaN, counted; row 2: 1 + 1 = 2
    assert res.excluded.tolist() == [True, True, False] and res.counts["excluded"] == 2
    assert res.total[:2].isnan().all() and res.total[2] == 2.0
    # a Python float beyond float32 (finite as a float64) is excluded too, not turned into inf
    res = score([_const([1e39, 0.5], "wide")], ["p"] * 2, ["a", "b"], {})
    assert (
        res.excluded.tolist() == [True, False] and res.counts["excluded"] == 1 and torch.isfinite(res.total[1:]).all()
    )


class _Policy:
    on_error, missing, timeout_s, max_error_rate = "raise", "exclude", 0.0, 0.1


def _decode(rollout):
    B, G, _ = rollout.shape
    return [
        [" ".join(map(str, rollout.actions[b, g][rollout.mask[b, g]].tolist())) for g in range(G)] for b in range(B)
    ]


def test_reward_stage_counts_overflow_in_excluded():
    # what the trainer logs as reward_excluded: 2 groups × 2 rows; row (0,0) scores 3e38 twice → 6e38
    stage = RewardStage([], _Policy(), _decode, max_new_tokens=3)
    big = _const([3e38, 1.0, 0.0, 1.0], "big")
    stage.text = [big, big]
    ro = make_rollout(B=2, G=2, T=3, awkward=False)
    ro.meta = [{"prompt": "p0"}, {"prompt": "p1"}]
    stage.score_local(ro)
    stage.finish(ro, info_for(3))
    assert stage.excluded == 1
    assert ro.rewards[0, 0].isnan() and ro.rewards.flatten()[1:].tolist() == [2.0, 0.0, 2.0]
    assert ro.group_valid.tolist() == [[False, True], [True, True]]
