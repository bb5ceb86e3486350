"""PCM (specs/13): phase keep probabilities, success–failure divergence, chunk sampling, the token
weight, worked by hand.

Spec unit test (share then max normalisation, floor p_min = 0.1)::

    C = [0.9, 0.3, 0.0, 0.6, 0.2]     ΣC = 2.0
    ρ = C/ΣC = [0.45, 0.15, 0, 0.3, 0.1];   ρ̃ = ρ/0.45 = [1, 0.3333, 0, 0.6667, 0.2222]
    p = max(0.1, ρ̃) = [1, 0.3333, 0.1, 0.6667, 0.2222]

Divergence: successes {[1,0],[1,0]} → μ⁺ = [1,0]; failure {[0,0]} → μ⁻ = [0,0]; C = ‖[1,0]‖ = 1.

Text group (chunk_size 1, phase = position): successes "5 7", "5 8"; failure "5 9"
    phase 0: μ⁺ = e(5) = μ⁻ → C₀ = 0
    phase 1: μ⁺ = ½e(7) + ½e(8), μ⁻ = e(9) → ‖(½, ½, −1)‖ = √1.5 = 1.224745
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import info_for, permute_rows, permute_tensor, random_perm, rollout_from
from test_trainer import make_trainer

from groupwise.registry import build
from groupwise.run import Run
from groupwise.weights.pcm import (
    keep_probabilities,
    phase_divergence,
    sample_chunks,
    token_chunks,
    token_phase_divergence,
)

SQRT_1_5 = math.sqrt(1.5)


def _close(actual, expected, atol=1e-4):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
        equal_nan=True,
    )


def test_spec_keep_probabilities():
    _close(keep_probabilities(torch.tensor([0.9, 0.3, 0.0, 0.6, 0.2]), 0.1), [1, 0.3333, 0.1, 0.6667, 0.2222])
    # a NaN phase (never scored) keeps p = 1; all zero → every p 1 (no evidence yet)
    _close(keep_probabilities(torch.tensor([0.2, float("nan"), 0.1]), 0.1), [1.0, 1.0, 0.5])
    _close(keep_probabilities(torch.zeros(3), 0.1), [1.0, 1.0, 1.0])


def test_spec_divergence_and_skipped_phase():
    # [N=3,K=2,A=2]
    actions = torch.tensor([[[1.0, 0.0], [1.0, 1.0]], [[1.0, 0.0], [3.0, 3.0]], [[0.0, 0.0], [0.0, 0.0]]])
    phase = torch.tensor([[0, 1], [0, 1], [0, 2]])  # phase 1 holds successes only, phase 2 a failure only
    success = torch.tensor([True, True, False])
    C = phase_divergence(actions, phase, success, torch.ones(3, 2, dtype=torch.bool), 3)
    _close(C, [1.0, float("nan"), float("nan")])  # ‖[1,0] − [0,0]‖ = 1; phases 1, 2 skipped
    w = build("weight", "pcm", num_phases=3, refresh=5)
    w._update(torch.tensor([0.5, 0.2, 0.0]), step=0)  # first batch: refresh at once
    state = w.state_dict()
    w._update(C, step=1)  # the skipped phases keep their (empty) buffers
    assert w.state_dict()["buffers"] == [[1.0], [], []] and state["buffers"] == [[], [], []]


def test_refresh_every_T_rc_steps():
    # refresh = 2: step 0 refreshes (first batch): C̄ = [1, .5, nan] → ρ̃ = [1, .5] → p = [1, .5, 1]
    w = build("weight", "pcm", num_phases=3, refresh=2, p_min=0.1)
    _close(w._update(torch.tensor([1.0, 0.5, float("nan")]), step=0), [1.0, 0.5, 1.0])
    _close(w._update(torch.tensor([0.0, 1.0, float("nan")]), step=1), [1.0, 0.5, 1.0])  # 1 step since: held fixed
    # same step again: no second append
    _close(w._update(torch.tensor([0.0, 1.0, float("nan")]), step=1), [1.0, 0.5, 1.0])
    # step 2: 2 steps since → C̄ = mean([0,0]), mean([1,1]) = [0, 1] → ρ̃ = [0, 1] → p = [0.1, 1, 1]
    _close(w._update(torch.tensor([0.0, 1.0, float("nan")]), step=2), [0.1, 1.0, 1.0])


def _group(chunk_size=1):
    tokens = torch.tensor([[5, 7, 0], [5, 8, 0], [5, 9, 0]])  # [G=3,T=3], EOS 0 everywhere
    mask = torch.ones(3, 3, dtype=torch.bool)
    chunk, offset = token_chunks(tokens, mask, chunk_size, [])
    return tokens, mask, chunk, offset


def test_text_divergence_by_hand_and_equal_to_one_hot_actions():
    tokens, mask, chunk, offset = _group()
    success = torch.tensor([True, True, False])
    C = token_phase_divergence(tokens, chunk, offset, chunk.clamp(max=2), success, mask, 3)
    _close(C, [0.0, SQRT_1_5, 0.0])
    onehot = torch.nn.functional.one_hot(tokens, 10).double()  # [G,K=3,A=10]: chunk = one token
    _close(phase_divergence(onehot, torch.arange(3).expand(3, 3), success, mask, 3), C, atol=1e-12)
    # chunk_size 2: chunk 0 = "5 7" etc. (action = one-hot of (offset, token)): the same √1.5 in phase 0,
    # chunk 1 = the EOS alone, equal everywhere → 0
    tokens, mask, chunk, offset = _group(2)
    _close(token_phase_divergence(tokens, chunk, offset, chunk, success, mask, 2), [SQRT_1_5, 0.0])


def test_per_group_divergence_is_not_batch_pooling():
    # Note 1's numbers. Two groups, one token per row (chunk_size 1, one phase), reward 1 = success:
    #   group 0: success "5", failure "7";  group 1: success "7", failure "5"
    #   per group C = ‖e5 − e7‖ = √2 (both) → the weight's C0 = mean = 1.414214
    #   batch pooling: μ⁺ = (e5 + e7)/2 = μ⁻ → 0 (the paper's statistic, which this weight does not compute)
    ro = rollout_from(torch.zeros(2, 2, 1), torch.zeros(2, 2), rewards=torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    ro.actions = torch.tensor([[[5], [7]], [[7], [5]]])
    w = build("weight", "pcm", chunk_size=1, num_phases=1)
    w(ro, info_for(1))
    assert w.step_stats()["pcm/C0"] == pytest.approx(math.sqrt(2.0))
    tokens, ones = ro.actions.reshape(4, 1), torch.ones(4, 1, dtype=torch.bool)
    zeros = torch.zeros(4, 1, dtype=torch.long)
    pooled = token_phase_divergence(tokens, zeros, zeros, zeros, torch.tensor([True, False, True, False]), ones, 1)
    _close(pooled, [0.0], atol=1e-12)


def test_delimiter_segments():
    tokens = torch.tensor([[3, 27, 4, 4, 199, 6, 0]])
    mask = torch.tensor([[True] * 6 + [False]])
    chunk, offset = token_chunks(tokens, mask, 8, [27, 199])  # ';' = 27, newline = 199 in the shipped tokenizer
    assert chunk.tolist() == [[0, 0, 1, 1, 1, 2, -1]] and offset.tolist() == [[0, 1, 0, 1, 2, 0, -1]]


def test_sample_chunks_spec_cases_and_plackett_luce_frequency():
    valid = torch.tensor([[True, True, True], [True, True, False]])
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        # budget ≥ N_i keeps all valid
        assert sample_chunks(torch.rand(2, 3, generator=g), 3, valid, g).tolist() == valid.tolist()
        assert sample_chunks(torch.tensor([[1.0, 0.0, 0.0]]), 1, torch.ones(1, 3, dtype=torch.bool), g).tolist() == [
            [True, False, False]
        ]
    # weights [3, 1], budget 1: P(first) = 3/4 (10,000 draws, sd 0.0043)
    keep = sample_chunks(
        torch.tensor([[3.0, 1.0]]).expand(10_000, 2),
        1,
        torch.ones(10_000, 2, dtype=torch.bool),
        torch.Generator().manual_seed(0),
    )
    assert keep.sum(1).eq(1).all() and abs(float(keep[:, 0].float().mean()) - 0.75) < 0.02


def _rollout():
    """One group (G=4, T=3): the hand group above + an invalid row; a second, constant group."""
    # [B=2,G=4,T=3]
    actions = torch.tensor([[[5, 7, 0], [5, 8, 0], [5, 9, 0], [1, 1, 1]], [[2, 3, 0], [2, 4, 0], [2, 3, 0], [2, 6, 0]]])
    ro = rollout_from(
        torch.zeros(2, 4, 3),
        torch.zeros(2, 4),
        actions=actions,
        rewards=torch.tensor([[1.0, 1.0, 0.0, float("nan")], [1.0] * 4]),
    )
    ro.group_valid[0, 3] = False
    ro.mask[1, 3, 2] = False  # a masked token
    return ro


def test_weight_by_hand_budget_one_token():
    # group 0: C = [0, √1.5, 0] → p = [0.1, 1, 0.1]; group 1 (all succeed) adds nothing
    w = build("weight", "pcm", budget=1, chunk_size=1, num_phases=3, p_min=0.1)
    hits, rows = 0, 0
    for step in range(400):
        weight = w(_rollout(), info_for(3, step))  # [B,G,T]
        if step == 0:
            _close(w.step_stats()["pcm/C1"], SQRT_1_5)
            assert [w.step_stats()[f"pcm/p{c}"] for c in range(3)] == pytest.approx([0.1, 1.0, 0.1])
            # 7 valid rows keep 1 token each of 3 (row (1,3) has 2 loss tokens): 7 / 20 loss tokens
            assert w.step_stats()["pcm/kept_token_frac"] == pytest.approx(7 / 20)
        assert weight[0, 3].eq(0).all() and weight[1, 3, 2] == 0  # invalid row, masked token: 0
        assert weight[:, :3].sum(-1).eq(1).all()  # one token a valid row
        hits += int(weight[0, :3, 1].sum())
        rows += 3
    # Plackett–Luce top-1 with weights [0.1, 1, 0.1]: P(units digit) = 1/1.2 = 0.8333 (1,200 draws, sd 0.011)
    assert abs(hits / rows - 1 / 1.2) < 0.04


def test_reweight_constant_group_and_permutation():
    w = build("weight", "pcm", budget=2, chunk_size=1, num_phases=3, p_min=0.1, reweight=True)
    weight = w(_rollout(), info_for(3))
    kept = weight[0, :3][weight[0, :3] > 0]  # two of three tokens per row, each 1/p ∈ {10, 1}
    assert kept.numel() == 6 and set(kept.tolist()) <= {10.0, 1.0}
    const = build("weight", "pcm", budget=1, chunk_size=1, num_phases=3)
    ro = _rollout()
    ro.rewards[0] = torch.tensor([1.0, 1.0, 1.0, float("nan")])  # every group constant: no divergence, p stays 1
    const(ro, info_for(3))
    assert [const.step_stats()[f"pcm/p{c}"] for c in range(3)] == [1.0, 1.0, 1.0] and "pcm/C1" not in const.step_stats()
    ro, perm = _rollout(), random_perm(2, 4, seed=4)
    a = build("weight", "pcm", budget=1, chunk_size=1, num_phases=3)(ro, info_for(3, 5))
    b = build("weight", "pcm", budget=1, chunk_size=1, num_phases=3)(permute_rows(ro, perm), info_for(3, 5))
    assert torch.equal(b, permute_tensor(a, perm))  # the chunk noise follows the row, not its slot


def test_state_round_trip():
    a = build("weight", "pcm", budget=1, chunk_size=1, num_phases=3, refresh=3)
    for step in range(4):
        a(_rollout(), info_for(3, step))
    b = build("weight", "pcm", budget=1, chunk_size=1, num_phases=3, refresh=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert all(torch.equal(a(_rollout(), info_for(3, s)), b(_rollout(), info_for(3, s))) for s in range(4, 9))
    with pytest.raises(ValueError, match="phases"):
        build("weight", "pcm", num_phases=2).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="budget"):
        build("weight", "pcm", budget=0)


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_composes_with_each_objective(tmp_path, objective):
    trainer = make_trainer(
        tmp_path,
        f'objective.terms=["{objective}", {{name="kl", coef=0.04}}]',
        'objective.weights=[{name="pcm", budget=1, chunk_size=1, num_phases=3}]',
        "train.steps=2",
        "eval.size=0",
    )
    seen = {}
    observe = trainer.observe
    trainer.observe = lambda batch: (seen.update(batch=batch), observe(batch))
    Run(trainer).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    batch = seen["batch"]
    loss = batch.row_mask  # [B,G,T]
    kept = (batch.weight != 0) & loss
    assert rows[1]["pcm/kept_token_frac"] == pytest.approx(float(kept.sum() / loss.sum()))
    assert 0 < rows[1]["pcm/kept_token_frac"] < 1 and kept.sum(-1)[loss.any(-1)].eq(1).all()  # one token a row
    assert torch.equal(trainer.objective.loss_mask(batch), kept)  # dropped tokens leave the loss and its normaliser
    assert any(f"pcm/p{c}" in rows[1] for c in range(3))
