"""HORA hit utility and greedy rollout allocation (spec 53), worked by hand.

Counts (s, n) with the uniform prior: all-fail (0,4) → a=1, b=5; saturated (4,4) → a=5, b=1;
mixed (2,4) → a=b=3. U(m) = 1 − Π_{j<m} (b+j)/(a+b+j).
"""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest
import torch

from groupwise.rollout.hora import hit_utility, hora_allocate, marginal_gain
from groupwise.run import Run

S, N = [0, 4, 2], [4, 4, 4]  # [fail, saturated, mixed]


def _exact_u(s, n, m, a0=1, b0=1) -> Fraction:
    """Brute-force reference: U(m) as an exact rational from the product form."""
    a, b = Fraction(a0 + s), Fraction(b0 + n - s)
    q = Fraction(1)
    for j in range(m):
        q *= (b + j) / (a + b + j)
    return 1 - q


@pytest.mark.parametrize(
    "s, n, expected",
    [
        (0, 4, [0.166667, 0.285714, 0.375, 0.444444, 0.5]),  # 1 − 5/6, 1 − 5/6·6/7, … = 1 − 5/(5+m)
        (4, 4, [0.833333, 0.952381, 0.982143, 0.992063, 0.996032]),  # 1 − 1/6, 1 − 1/6·2/7, …
        (2, 4, [0.5, 0.714286, 0.821429, 0.880952, 0.916667]),  # 1 − 3/6, 1 − 3/6·4/7, …
    ],
)
def test_hit_utility_spec_numbers(s, n, expected):
    m = torch.arange(1, 6)
    U = hit_utility(torch.full((5,), s), torch.full((5,), n), m)
    assert U.dtype == torch.float32
    torch.testing.assert_close(U, torch.tensor(expected), atol=1e-6, rtol=0)


def test_marginal_gain_is_the_utility_step():
    # (0,4): Δ(m) = U(m+1) − U(m) = 5/((5+m)(6+m)): 1/6, 5/42, 5/56, 5/72, 5/90
    gain = marginal_gain(torch.zeros(5), torch.full((5,), 4.0), torch.arange(5))
    torch.testing.assert_close(gain, torch.tensor([1 / 6, 5 / 42, 5 / 56, 5 / 72, 5 / 90]))
    # (4,4) at m=1: 1/6 · 5/7 = 5/42 as well — an exact tie with (0,4) at m=1
    assert marginal_gain([4], [4], 1).item() == pytest.approx(5 / 42, rel=1e-6)


def test_utility_far_out_is_finite_and_increasing():
    U = hit_utility(torch.zeros(4), torch.full((4,), 100.0), torch.tensor([0, 1, 1000, 100000]))
    assert torch.isfinite(U).all() and U[0] == 0
    assert (U[1:] > U[:-1]).all()  # 1/102, then 1 − 101/1101, 1 − 101/100101


@pytest.mark.parametrize("budget, expected", [(4, [1, 1, 2]), (5, [2, 1, 2]), (8, [3, 2, 3])])
def test_greedy_spec_numbers(budget, expected):
    # gains in greedy order: sat Δ(0)=.8333, mixed Δ(0)=.5, mixed Δ(1)=.2143, fail Δ(0)=.1667 (M=4),
    # fail Δ(1)=5/42 ties sat Δ(1)=5/42 → lowest index, fail (M=5); sat Δ(1) (M=6); mixed Δ(2)=.1071 (M=7);
    # fail Δ(2)=.0893 (M=8)
    m = hora_allocate(torch.tensor(S), torch.tensor(N), budget)
    assert m.dtype == torch.int64 and m.tolist() == expected


def test_exact_tie_breaks_by_index_not_rounding():
    # reorder as [sat, fail, mixed]: the 5/42 tie at M=5 now goes to the saturated prompt (index 0)
    assert hora_allocate([4, 0, 2], [4, 4, 4], 5).tolist() == [2, 1, 2]
    # two identical prompts: the extra rollout goes to the first
    assert hora_allocate([1, 1], [3, 3], 3).tolist() == [2, 1]


def _brute_best(s, n, M, lo=0, hi=None):
    hi = M if hi is None else hi
    best = None
    for alloc in itertools.product(range(lo, hi + 1), repeat=len(s)):
        if sum(alloc) == M:
            total = sum(_exact_u(si, ni, mi) for si, ni, mi in zip(s, n, alloc))
            best = total if best is None or total > best else best
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_brute_force(seed):
    rng = random.Random(seed)
    n = [rng.randint(1, 8) for _ in range(4)]
    s = [rng.randint(0, ni) for ni in n]
    for M in range(0, 9):
        m = hora_allocate(s, n, M).tolist()
        assert sum(m) == M
        got = sum(_exact_u(si, ni, mi) for si, ni, mi in zip(s, n, m))
        assert got == _brute_best(s, n, M), (s, n, M, m)  # exact rationals: optimal, not just close
        if M >= 4:  # with bounds 1 <= m <= 3 (capacity 12 >= 8)
            m = hora_allocate(s, n, M, min_alloc=1, max_alloc=3).tolist()
            assert sum(m) == M and min(m) >= 1 and max(m) <= 3
            got = sum(_exact_u(si, ni, mi) for si, ni, mi in zip(s, n, m))
            assert got == _brute_best(s, n, M, lo=1, hi=3), (s, n, M, m)


def test_min_and_max_caps():
    # min_alloc=3, M=10: start [3,3,3]; gains fail Δ(3)=.0694 > mixed Δ(3)=.0595 > sat Δ(3)=.0099 → fail
    assert hora_allocate(S, N, 10, min_alloc=3).tolist() == [4, 3, 3]
    # max_alloc=2: uncapped M=7 gives [2,2,3]; capped, M=6 already puts every prompt at 2 → the 7th is unspent
    assert hora_allocate(S, N, 7, max_alloc=2).tolist() == [2, 2, 2]
    assert hora_allocate(S, N, 5, max_alloc=1).tolist() == [1, 1, 1]  # capacity 3 < budget 5


def test_only_unsolved():
    # solved prompts (s > 0) stay at min_alloc; the whole budget goes to the all-fail prompt
    assert hora_allocate(S, N, 5, only_unsolved=True).tolist() == [5, 0, 0]
    assert hora_allocate(S, N, 5, min_alloc=1, only_unsolved=True).tolist() == [3, 1, 1]
    # two unsolved prompts with different n: (0,2) has Δ(0)=1/4 > (0,6) Δ(0)=1/8
    assert hora_allocate([0, 3, 0], [2, 4, 6], 1, only_unsolved=True).tolist() == [1, 0, 0]
    # nothing unsolved: only the floor is spent
    assert hora_allocate([1, 4], [4, 4], 6, min_alloc=2, only_unsolved=True).tolist() == [2, 2]


def test_fractional_history_counts():
    # decayed counts s=0.5, n=1.5 → a=1.5, b=2: Δ(0) = 1.5/3.5 = 0.4286 beats (0,4)'s 1/6
    assert hora_allocate([0.5, 0.0], [1.5, 4.0], 1).tolist() == [1, 0]
    torch.testing.assert_close(hit_utility([0.5], [1.5], [1]), torch.tensor([1.5 / 3.5]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"s": [3], "n": [2], "budget": 2}, "0 <= s <= n"),
        ({"s": [0, 1], "n": [2], "budget": 2}, "same length"),
        ({"s": [0], "n": [2], "budget": 2, "a0": 0.0}, "a0 > 0"),
        ({"s": [0, 0], "n": [2, 2], "budget": 3, "min_alloc": 2}, "raise the budget"),
        ({"s": [0], "n": [2], "budget": 2, "min_alloc": 2, "max_alloc": 1}, "max_alloc"),
        ({"s": [0], "n": [2], "budget": -1}, "budget"),
    ],
)
def test_bad_inputs_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hora_allocate(**kwargs)


# ---------------------------------------------------------------------------- the strategy (rollout.name = "hora")
class _Ctx:
    """A rollout context over a table of rewards: row j of prompt `key` scores table[key][j]."""

    def __init__(self, table, batch_size, group_size):
        self.table, self.batch_size, self.group_size = table, batch_size, group_size
        self.calls = []

    def draw(self, n, round_=0):
        return list(range(n))

    def rollout(self, requests, round_=0):
        from groupwise.types import Rollout

        self.calls.append([(r.key, r.n, r.offset) for r in requests])
        B, G = len(requests), max(r.n for r in requests)
        valid = torch.tensor([[j < r.n for j in range(G)] for r in requests])  # [B,G]
        rewards = torch.tensor(
            [[self.table[r.key][r.offset + j] if j < r.n else float("nan") for j in range(G)] for r in requests]
        )  # [B,G]
        ro = Rollout(
            prompt_ids=[[r.key] for r in requests],
            actions=torch.ones(B, G, 2, dtype=torch.long),
            mask=valid[..., None].expand(B, G, 2).clone(),
            group_valid=valid,
            truncated=torch.zeros(B, G, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests]),
        )
        ro.rewards = rewards
        return ro

    def keep(self, batch):
        return torch.ones(batch.shape[0], dtype=torch.bool)


def test_strategy_spends_the_budget_where_hits_are_likely_and_joins_the_groups():
    from groupwise.registry import build

    # prompt 0 never solved, prompt 1 always, prompt 2 half the time (first 4 rows: s = 0, 4, 2)
    table = {0: [0.0] * 16, 1: [1.0] * 16, 2: [1.0, 0.0] * 8}
    ctx = _Ctx(table, batch_size=3, group_size=8)  # budget 24 = 3 prompts x 8
    batch = build("rollout", "hora")(ctx)  # initial = 4
    extra = hora_allocate([0, 4, 2], [4, 4, 4], 12).tolist()
    assert sum(extra) == 12 and extra[0] > extra[1]  # the unsolved prompt gets more than the saturated one
    assert ctx.calls[0] == [(0, 4, 0), (1, 4, 0), (2, 4, 0)]
    assert ctx.calls[1] == [(b, m, 4) for b, m in enumerate(extra) if m > 0]  # fresh samples: index offset 4
    assert batch.group_valid.sum(1).tolist() == [4 + m for m in extra]  # ragged groups, 24 rows in all
    for b in range(3):
        rows = batch.rewards[b][batch.group_valid[b]].tolist()
        assert rows == table[b][: 4 + extra[b]]  # the prompt's rows in order: first round, then the allocation


def test_strategy_budget_and_caps():
    from groupwise.errors import ConfigError
    from groupwise.registry import build

    table = {i: [0.0] * 32 for i in range(2)}
    ctx = _Ctx(table, batch_size=2, group_size=8)
    batch = build("rollout", "hora", max_per_prompt=6)(ctx)  # 16 rows wanted, at most 6 per prompt
    assert batch.group_valid.sum(1).tolist() == [6, 6]
    with pytest.raises(ConfigError, match="budget=4 is less than initial=4 rows for each of 2 prompts"):
        build("rollout", "hora", budget=4)(_Ctx(table, 2, 8))


def test_join_rows_by_level():
    from groupwise.types import Rollout

    def ro(B, G, T, fill):
        r = Rollout(
            prompt_ids=[[b] for b in range(B)],
            actions=torch.full((B, G, T), fill),
            mask=torch.ones(B, G, T, dtype=torch.bool),
            group_valid=torch.ones(B, G, dtype=torch.bool),
            truncated=torch.zeros(B, G, dtype=torch.bool),
            prompt_index=torch.arange(B),
        )
        r.rewards = torch.full((B, G), float(fill))
        r.set_extra("w", torch.full((B,), float(fill)), "group")
        r.set_extra("tok", torch.full((B, G, T), float(fill)), "token")
        return r

    a, b = ro(3, 2, 4, 1), ro(1, 3, 5, 7)  # b: 3 more rows of a's group 2, longer completions
    j = a.join_rows(b, [2])
    assert j.shape == (3, 5, 5)
    assert j.group_valid.tolist() == [[True, True, False, False, False]] * 2 + [[True] * 5]
    assert j.rewards[2].tolist() == [1, 1, 7, 7, 7] and j.rewards[0, 2:].tolist() == [0, 0, 0]
    assert j.actions[0, 0].tolist() == [1, 1, 1, 1, 0] and j.actions[2, 4].tolist() == [7] * 5  # tokens padded to T = 5
    # group level kept, token level joined
    assert j.extras["w"].tolist() == [1, 1, 1] and j.extras["tok"][2, 3].tolist() == [7] * 5
    assert j.prompt_ids == a.prompt_ids and j.prompt_index.tolist() == [0, 1, 2]


def test_hora_trains_through_the_trainer(tmp_path):
    from test_trainer import make_trainer

    trainer = make_trainer(
        tmp_path / "run", "train.steps=2", "eval.size=0", 'rollout.name="hora"', "rollout.params={initial=2}"
    )
    batch = trainer.prepare(trainer.collect())
    sizes = batch.group_valid.sum(1)  # [B] 2 + the allocation each
    assert int(sizes.sum()) == 4 * 4 and int(sizes.min()) >= 2  # the budget: prompts_per_step x group_size rows
    assert torch.isfinite(batch.advantages).all() and (batch.advantages[~batch.group_valid] == 0).all()
    Run(trainer).train()
    assert trainer.step == 2
