"""GraphDPO (specs/46): Plackett–Luce-style DPO over a group's preference DAG, by hand.

Spec unit test: h = [2, 1, 0, −1], scores [1, .5, .5, 0] → layers [0, 1, 1, 2]::

    loss_0 = −2 + log(e² + e + 1 + e⁻¹) = 0.440190   (dominates 1, 2, 3)
    loss_1 = −1 + log(e + e⁻¹)          = 0.126928   (dominates 3 only: 2 is in its layer)
    loss_2 =  0 + log(1 + e⁻¹)          = 0.313262
    node 3 dominates nothing: no term.  L = (0.440190 + 0.126928 + 0.313262)/3 = 0.293460
    ∂L/∂h = [−0.118695, 0.039227, −0.060599, 0.140068]
DPO: h = [1, 0] → −log σ(1) = 0.313262.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import check_micro_batching, info_for, leaf, make_rollout, objective_for, rollout_from, train_recorded

from groupwise.losses.graphdpo import graphdpo_node_losses, preference_layers
from groupwise.registry import build
from groupwise.types import Need

H = [2.0, 1.0, 0.0, -1.0]
SCORES = [1.0, 0.5, 0.5, 0.0]
DH = [-0.118695, 0.039227, -0.060599, 0.140068]


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _group(h, scores, T=2):
    """One group whose rows have Σ_t (logp − logp_ref) = h: logp_ref = −1 per token, logp = −1 + h/T."""
    G = len(h)
    ro = rollout_from(
        torch.zeros(1, G, T), torch.zeros(1, G), rewards=torch.tensor([scores]), logp_ref=torch.full((1, G, T), -1.0)
    )
    logp = leaf([[[-1.0 + v / T] * T for v in h]])
    return ro, logp


def _loss_grad(term, ro, logp, agg="seq_mean_token_mean"):
    obj = objective_for([term], agg)
    info = info_for(ro.shape[2])
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


# ---------------------------------------------------------------------------------------------- spec numbers
def test_spec_layers_losses_and_gradient():
    h, s, node = torch.tensor([H]), torch.tensor([SCORES]), torch.ones(1, 4, dtype=torch.bool)
    assert preference_layers(s, node).tolist() == [[0, 1, 1, 2]]
    loss, has = graphdpo_node_losses(h, s, node)
    _close(loss, [[0.440190, 0.126928, 0.313262, 0.0]])
    assert has.tolist() == [[True, True, True, False]]
    # through the objective (beta = 1; each row's 2 tokens share ∂L/∂h_i: ∂h_i/∂logp_t = 1)
    ro, logp = _group(H, SCORES)
    L, grad = _loss_grad(build("objective", "graphdpo", beta=1.0), ro, logp)
    _close(L, 0.293460)
    _close(grad, [[[g, g] for g in DH]])


def test_one_pair_is_dpo():
    # h = beta·Δ: logp − logp_ref sums [1.5, −0.5] → Δ = 2, beta = 0.1 → −log σ(0.2) = log(1 + e^−0.2) = 0.598139
    # ∂/∂logp_t of the winner = −beta·σ(−0.2) = −0.1·0.450166 = −0.045017; the loser +0.045017
    ro, logp = _group([1.5, -0.5], [1.0, 0.0])
    L, grad = _loss_grad(build("objective", "graphdpo"), ro, logp)
    _close(L, math.log1p(math.exp(-0.2)))
    _close(L, 0.598139)
    _close(grad, [[[-0.045017] * 2, [0.045017] * 2]])
    ro, logp = _group([1.0, 0.0], [0.0, 1.0])  # the spec's check, order reversed: h = [1, 0], row 1 preferred
    L, _ = _loss_grad(build("objective", "graphdpo", beta=1.0), ro, logp)
    _close(L, math.log1p(math.exp(1.0)))  # −log σ(0 − 1) = 1.313262
    ro, logp = _group([1.0, 0.0], [1.0, 0.0])
    _close(_loss_grad(build("objective", "graphdpo", beta=1.0), ro, logp)[0], 0.313262)


def test_ties_form_layers_with_no_loss_between_them():
    ro, logp = _group(H, [0.5] * 4)  # every score equal: one layer, no term
    L, grad = _loss_grad(build("objective", "graphdpo"), ro, logp)
    assert L == 0 and torch.equal(grad, torch.zeros_like(grad))
    # two tied winners over two tied losers: each winner's denominator has
    # itself and both losers, never the other winner
    # h = [1, 0, 0, −1], scores [1, 1, 0, 0] → loss_0 = −1 + log(e + 1 + e⁻¹) = 0.407606,
    # loss_1 = log(1 + 1 + e⁻¹) = 0.861994
    s = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert preference_layers(s, torch.ones(1, 4, dtype=torch.bool)).tolist() == [[0, 0, 1, 1]]
    loss, has = graphdpo_node_losses(torch.tensor([[1.0, 0.0, 0.0, -1.0]]), s, torch.ones(1, 4, dtype=torch.bool))
    _close(loss, [[0.407606, 0.861994, 0.0, 0.0]])
    # layers skip no rank: scores [3, 3, 1, 2, 1] → distinct 3 > 2 > 1 → [0, 0, 2, 1, 2]
    assert preference_layers(torch.tensor([[3.0, 3, 1, 2, 1]]), torch.ones(1, 5, dtype=torch.bool)).tolist() == [
        [0, 0, 2, 1, 2]
    ]


def test_invalid_nan_and_empty_rows_are_not_nodes():
    # the spec's group plus an invalid row (the best score, a huge h), a NaN reward and an empty completion
    ro, logp = _group([*H, 9.0, 9.0, 9.0], [*SCORES, 5.0, float("nan"), 7.0])
    ro.group_valid[0, 4] = False
    ro.mask[0, 6] = False
    term = build("objective", "graphdpo", beta=1.0)
    L, grad = _loss_grad(term, ro, logp)
    _close(L, 0.293460)  # the spec's value: 4 nodes, the NaN row counts in the row mean but the scaling undoes it
    _close(grad[0, :4], [[g, g] for g in DH])
    assert torch.equal(grad[0, 4:], torch.zeros(3, 2))
    layers = preference_layers(ro.rewards, torch.tensor([[True] * 4 + [False] * 3]))
    assert layers.tolist() == [[0, 1, 1, 2, -1, -1, -1]]
    stats = term.stats(ro, {"logp": logp})
    assert stats["graphdpo/term_frac"].tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    assert stats["graphdpo/acc"].tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]  # h ordered as the scores
    # normalize = "rows": Σ loss over the 5 rows with loss tokens (the NaN row counts, as 0) → 0.880380/5
    _close(_loss_grad(build("objective", "graphdpo", beta=1.0, normalize="rows"), ro, logp)[0], 0.880380 / 5)


def test_scores_from_advantages_rank_like_the_rewards():
    ro, logp = _group(H, SCORES)
    ro.advantages = build("advantage", "grpo")(ro, info_for(2))  # monotone in the reward within the group
    L, grad = _loss_grad(build("objective", "graphdpo", beta=1.0, scores="advantages"), ro, logp)
    _close(L, 0.293460)
    ro.advantages = torch.tensor([[0.0, 1.0, 2.0, 3.0]])  # a shaper's reversed order: row 3 now the best
    # h = [2, 1, 0, −1] reversed ranking: loss_3 = 1 + log(e^−1 + 1 + e + e²) = 3.440190,
    # loss_2 = log(1 + e + e²) = 2.407606,
    # loss_1 = −1 + log(e + e²) = 1.313262 → mean 2.387019
    _close(_loss_grad(build("objective", "graphdpo", beta=1.0, scores="advantages"), ro, logp)[0], 2.387019)


def test_micro_batching_invariance():
    ro = make_rollout(6, 4, 5, seed=3)  # awkward: invalid row, NaN reward, empty row, garbage padding
    check_micro_batching(
        objective_for([build("objective", "graphdpo")], "seq_mean_token_mean"),
        ro,
        [[0, 4], [1], [2, 3, 5]],
        info_for(5),
    )


def test_declaration_and_errors():
    term = build("objective", "graphdpo")
    assert term.needs == (Need("logp", model="ref"),) and term.agg == "seq_mean_token_mean"
    for key, bad in (("beta", 0.0), ("scores", "ranks"), ("normalize", "none")):
        with pytest.raises(ValueError, match=key):
            build("objective", "graphdpo", **{key: bad})
    ro, logp = _group(H, SCORES)
    ro.logp_ref = None
    with pytest.raises(ValueError, match="logp_ref"):
        term(ro, {"logp": logp}, info_for(2))


# ---------------------------------------------------------------------------------------------- composition
def _expected_term_frac(batch):
    node = batch.row_mask.any(-1) & torch.isfinite(batch.rewards)  # [B,G]
    r = torch.where(node, batch.rewards, torch.zeros(()))
    has = (node[:, :, None] & node[:, None, :] & (r[:, None, :] < r[:, :, None])).any(-1)  # [B,G]
    return float(has.sum()) / float(batch.row_mask.any(-1).sum())


@pytest.mark.parametrize("estimator", ["grpo", "sign"])
@pytest.mark.parametrize("scores", ["rewards", "advantages"])
def test_trains_with_advantage_estimators(tmp_path, estimator, scores):
    rows, seen = train_recorded(
        tmp_path, "graphdpo", f'advantage.estimator="{estimator}"', f'objective.terms.graphdpo.scores="{scores}"'
    )
    for row, batch in zip(rows, seen):
        # the rows with a term, from the batch's rewards: with either estimator the advantages rank like the rewards
        assert row["graphdpo/term_frac"] == pytest.approx(_expected_term_frac(batch), abs=1e-6)
