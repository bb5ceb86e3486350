"""DGAO (specs/31): the dual group advantage, the order metrics and the permutation strategy, by hand.

Spec unit test, Q = 2 questions × O = 4 orders, alpha = 0.5::

    r     = [[1, 1, 0, 1], [0, 0, 1, 0]]
    g     = [.75, .25];  b = (.75 + .25)/2 = .5;  A_grp = [.25, −.25]
    A_ind = [[.25, .25, −.75, .25], [−.25, −.25, .75, −.25]]
    A     = .5·A_grp + .5·A_ind = [[.25, .25, −.25, .25], [−.25, −.25, .25, −.25]]   (= (r − b)/2)
Metrics: answers [[a, a, b, a]], gold a → consistency 3/4, overconfidence 0 (the common answer is right);
answers [[b, b, b, a]], gold a → consistency 3/4, overconfidence 3/4.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from helpers import info_for, make_rollout
from test_trainer import make_trainer

from groupwise.advantages.dgao import dgao_advantages
from groupwise.errors import ConfigError
from groupwise.registry import build
from groupwise.rollout.dgao import consistency_rate, make_order_variants, order_permutations, overconfidence_rate
from groupwise.run import Run

R = [[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
A = [[0.25, 0.25, -0.25, 0.25], [-0.25, -0.25, 0.25, -0.25]]


def _ro(r, valid=None):
    ro = make_rollout(len(r), len(r[0]), 3, awkward=False)
    ro.rewards = torch.tensor(r)
    if valid is not None:
        ro.group_valid = torch.tensor(valid)
    return ro


def test_spec_numbers():
    torch.testing.assert_close(dgao_advantages(torch.tensor(R)), torch.tensor(A, dtype=torch.float64))
    adv = build("advantage", "dgao")(_ro(R), info_for(3))
    assert adv.dtype == torch.float32 and adv.tolist() == A
    # alpha = 1: every row its group's A_grp; alpha = 0: r − g (Dr.GRPO)
    assert build("advantage", "dgao", alpha=1.0)(_ro(R), info_for(3)).tolist() == [[0.25] * 4, [-0.25] * 4]
    torch.testing.assert_close(
        build("advantage", "dgao", alpha=0.0)(_ro(R), info_for(3)), build("advantage", "dr_grpo")(_ro(R), info_for(3))
    )


def test_constant_groups_keep_credit_unlike_grpo():
    # all right in every order: g = 1, b = .5 → .5·.5 + .5·0 = .25; all wrong: −.25. GRPO gives both 0.
    est = build("advantage", "dgao")
    adv = est(_ro([[1.0] * 4, [0.0] * 4]), info_for(3))
    assert adv.tolist() == [[0.25] * 4, [-0.25] * 4]
    assert (build("advantage", "grpo")(_ro([[1.0] * 4, [0.0] * 4]), info_for(3)) == 0).all()
    assert est.step_stats() == {"dgao/baseline": 0.5, "dgao/constant_adv": 0.25}


def test_edge_cases():
    # a single group: b = g, A_grp = 0 → A = .5·(r − g): r = [1, 0] → g = .5 → [.25, −.25]
    assert build("advantage", "dgao")(_ro([[1.0, 0.0]]), info_for(3)).tolist() == [[0.25, -0.25]]
    # invalid row and NaN reward: exactly 0, out of every mean. Group 0: valid [1, 1, 0] → g0 = 1;
    # group 1: [0, NaN, 1] → g1 = .5; b = .75 → A0 = .5·.25 + .5·0 = .125; A1 = .5·(−.25) + .5·(r − .5)
    ro = _ro([[1.0, 1.0, 0.0], [0.0, float("nan"), 1.0]], valid=[[True, True, False], [True, True, True]])
    adv = build("advantage", "dgao")(ro, info_for(3))
    assert adv.tolist() == [[0.125, 0.125, 0.0], [-0.375, 0.0, 0.125]]
    # an empty group is left out of the baseline: b = g of group 0 = .5 → A = .5·(r − .5)
    ro = _ro([[1.0, 0.0], [1.0, 1.0]], valid=[[True, True], [False, False]])
    assert build("advantage", "dgao")(ro, info_for(3)).tolist() == [[0.25, -0.25], [0.0, 0.0]]
    with pytest.raises(ConfigError, match="alpha"):
        build("advantage", "dgao", alpha=1.5)


def test_metrics_by_hand():
    assert consistency_rate([list("aaba")]) == 0.75 and overconfidence_rate([list("aaba")], ["a"]) == 0.0
    assert consistency_rate([list("bbba")]) == 0.75 and overconfidence_rate([list("bbba")], ["a"]) == 0.75
    # two questions: (3/4 + 2/4)/2 = .625; normalised (case, spaces); ties → the first seen ("x", wrong → 1/2)
    assert consistency_rate([list("aaba"), ["x", " X", "y", "y"]]) == 0.625
    assert overconfidence_rate([["x", "y"]], ["y"]) == 0.5


def test_order_permutations():
    rng = random.Random(0)
    perms = order_permutations(4, 8, rng)
    assert len(set(perms)) == 8 and all(sorted(p) == [0, 1, 2, 3] for p in perms)  # distinct: 4! = 24 ≥ 8
    assert order_permutations(4, 8, random.Random(1), include_original=True)[0] == (0, 1, 2, 3)
    two = order_permutations(2, 4, random.Random(0))
    assert sorted(two) == [(0, 1), (0, 1), (1, 0), (1, 0)] and two[0] != two[1]  # 2! < 4: both orders, then repeated
    assert order_permutations(3, 5, random.Random(7)) == order_permutations(3, 5, random.Random(7))  # seeded
    variants = make_order_variants(["37", "45"], "{elements}=", 2, seed="s", sep="+")
    assert sorted(variants) == ["37+45=", "45+37="]


DGAO = [
    'data.task="addition_orders"',
    'rollout.name="dgao"',
    "rollout.params.num_orders=2",
    "rollout.params.rows_per_order=2",
    'rollout.params.sep="+"',
    "rollout.params.greedy_probe=true",
    "rollout.group_size=4",
    "train.steps=2",
    "eval.size=0",
]


def test_strategy_groups_one_question_under_its_orders(tmp_path):
    trainer = make_trainer(tmp_path, *DGAO, 'advantage.estimator="dgao"')
    batch = trainer.collect()
    B, G, _ = batch.shape
    assert (B, G) == (4, 4)
    for b in range(B):
        a, c = batch.meta[b]["elements"]
        prompts = [trainer.policy.tokenizer.decode(ctx) for ctx in batch.ctx[b]]
        assert sorted(set(prompts)) == sorted({f"{a}+{c}=", f"{c}+{a}="})  # both orders (one when a = c)
        assert prompts[0] == prompts[1] and prompts[2] == prompts[3]  # rows_per_order = 2
        assert all(batch.meta[b]["answer"] == str(int(a) + int(c)) for _ in prompts)
    stats = trainer.strategy.step_stats()
    assert set(stats) >= {"dgao/accuracy", "dgao/consistency", "dgao/overconfidence", "dgao/greedy_consistency"}
    assert 0.5 <= stats["dgao/greedy_consistency"] <= 1.0  # two greedy answers per question: 1/2 or 1 each


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_composes_with_objectives(tmp_path, objective):
    trainer = make_trainer(
        tmp_path, *DGAO, 'advantage.estimator="dgao"', f'objective.terms=["{objective}"]', "rollout.prompts_per_step=8"
    )
    seen = []
    observe = trainer.observe
    trainer.observe = lambda batch: (seen.append(batch), observe(batch))
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    for row, batch in zip(rows, seen):
        assert "dgao/greedy_consistency" in row and "dgao/baseline" in row
        torch.testing.assert_close(batch.advantages, dgao_advantages(batch.rewards, 0.5, batch.group_valid).float())
        # equal groups: mean of means
        assert row["dgao/baseline"] == pytest.approx(float(batch.rewards[batch.group_valid].mean()))
        assert batch.ctx  # rows carry their own contexts
    checked = 0
    for row, b in zip(rows, seen):  # a constant group whose mean is not the step's keeps its credit (GRPO gives it 0)
        valid = b.group_valid
        const = ((b.rewards == b.rewards[:, :1]) | ~valid).all(1) & valid.any(1)  # [B]
        off = const & (b.rewards[:, 0] != row["dgao/baseline"])  # [B]
        if off.any():
            checked += 1
            assert (b.advantages[off][valid[off]] != 0).all() and row["dgao/constant_adv"] > 0
    assert checked, "no constant group off the baseline in two steps: the check cannot fail; raise prompts_per_step"
