"""Token weights worked by hand: top-entropy (80/20) selection and DAPO overlong filtering."""

from __future__ import annotations

import pytest
import torch
from helpers import info_for, leaf, objective_for, rollout_from

from groupwise.registry import build
from groupwise.types import Need


def _with_entropy(H, mask=None, valid=None):
    H = torch.as_tensor(H, dtype=torch.float32)
    ro = rollout_from(torch.zeros(H.shape), torch.ones(H.shape[:2]), mask=mask)
    if valid is not None:
        ro.group_valid = torch.as_tensor(valid, dtype=torch.bool)
    ro.set_extra("entropy", H, "token")
    return ro


def test_top_entropy_keeps_top_fifth():
    # 10 masked tokens with H = 0.1 … 1.0, rho 0.2 → k = ceil(2) = 2 → keep H ∈ {0.9, 1.0}
    H = torch.arange(1, 11, dtype=torch.float32).view(1, 2, 5) / 10
    w = build("weight", "top_entropy")(_with_entropy(H), info_for(5))
    assert w.dtype == torch.float32
    assert w.flatten().tolist() == [0] * 8 + [1, 1]


def test_top_entropy_rounds_up_and_is_batch_level():
    H = torch.arange(1, 11, dtype=torch.float32).view(2, 1, 5) / 10  # two groups: threshold over both
    # rho 0.25 of 10 → ceil(2.5) = 3 → keep 0.8, 0.9, 1.0 (all in group 1)
    w = build("weight", "top_entropy", rho=0.25)(_with_entropy(H), info_for(5))
    assert w[0].sum() == 0 and w[1, 0].tolist() == [0, 0, 1, 1, 1]
    # 15 tokens, rho 0.2: 0.2·15 = 3.0000000000000004 in floating point → still k = 3, not 4
    H15 = torch.arange(15, dtype=torch.float32).view(1, 3, 5)
    w15 = build("weight", "top_entropy")(_with_entropy(H15), info_for(5))
    assert w15.sum() == 3 and w15.flatten()[-3:].tolist() == [1, 1, 1]


def test_top_entropy_ignores_masked_invalid_and_nonfinite_tokens():
    H = torch.tensor([[[9.0, 9.0, 0.1, 0.2, 0.3], [99.0, 99.0, 99.0, 99.0, 99.0]]])
    H[0, 0, 1] = float("nan")
    mask = torch.tensor([[[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]])
    # masked token (9.0), NaN entropy and the invalid row (99s) do not count: n = 3 tokens [0.1,0.2,0.3]
    # k = ceil(0.2·3) = 1 → keep 0.3 only
    w = build("weight", "top_entropy")(_with_entropy(H, mask, valid=[[1, 0]]), info_for(5))
    assert w.flatten().tolist() == [0, 0, 0, 0, 1] + [0] * 5


def test_top_entropy_ties_at_threshold_are_all_kept():
    # 10 tokens, rho 0.1 → k = 1 → tau = 1.0, three tokens tie at 1.0: all three kept (30 % > 10 %)
    H = torch.tensor([[[1.0, 0.5, 1.0, 0.2, 0.3], [0.4, 1.0, 0.1, 0.0, 0.6]]])
    w = build("weight", "top_entropy", rho=0.1)(_with_entropy(H), info_for(5))
    assert w.flatten().tolist() == [1, 0, 1, 0, 0, 0, 1, 0, 0, 0]


def test_top_entropy_edge_cases():
    assert build("weight", "top_entropy").needs == (Need("entropy"),)
    empty = _with_entropy(torch.ones(1, 2, 3), mask=torch.zeros(1, 2, 3))
    assert build("weight", "top_entropy")(empty, info_for(3)).sum() == 0
    assert build("weight", "top_entropy", rho=1.0)(_with_entropy(torch.rand(1, 2, 3)), info_for(3)).sum() == 6
    with pytest.raises(ValueError, match="entropy"):
        build("weight", "top_entropy")(rollout_from(torch.zeros(1, 1, 2), None), info_for(2))
    for rho in (0.0, 1.5):
        with pytest.raises(ValueError, match="rho"):
            build("weight", "top_entropy", rho=rho)


def test_mask_truncated_by_hand_and_through_objective():
    # row 0 truncated → every token weight 0; row 1 kept
    ro = rollout_from(torch.zeros(1, 2, 3), torch.tensor([[1.0, 1.0]]), truncated=torch.tensor([[True, False]]))
    w = build("weight", "mask_truncated")(ro, info_for(3))
    assert w.tolist() == [[[0, 0, 0], [1, 1, 1]]]
    ro.weight = w
    # reinforce A=1, logp = −1 everywhere: values 1 per token; token mean over row 1's 3 tokens = 1
    logp = leaf(-torch.ones(1, 2, 3))
    obj = objective_for([build("objective", "reinforce")])
    loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(3)), info_for(3))
    loss.backward()
    assert loss.item() == pytest.approx(1.0)
    assert logp.grad[0, 0].abs().sum() == 0 and torch.allclose(logp.grad[0, 1], torch.full((3,), -1 / 3))


def test_top_entropy_keeps_the_full_token_count_like_the_paper_and_trl():
    """One row, 5 tokens, entropies [5,1,4,2,3], rho = 0.4 → the top 2 kept (tokens 0 and 2).
    Terms: REINFORCE −adv·logp with adv = 1, logp = −2 → 2 per token; KL k2 = ½(logp − logp_ref)²
    with logp_ref = −1 → ½·1² = 0.5 per token, coef 1. Aggregation token_mean.
    scope="loss" (paper, TRL): policy (2 + 2) / 5 = 0.8; KL on all 5 tokens 2.5 / 5 = 0.5 → 1.3.
    scope="token" (removed): policy (2 + 2) / 2 = 2.0; KL on the 2 kept tokens 1.0 / 2 = 0.5 → 2.5."""
    from groupwise.objective import token_weights

    H = torch.tensor([[[5.0, 1.0, 4.0, 2.0, 3.0]]])  # [1,1,5]
    results = {}
    for scope in ("loss", "token"):
        ro = _with_entropy(H)
        ro.advantages = torch.ones(1, 1)
        ro.logp_ref = torch.full((1, 1, 5), -1.0)
        top = build("weight", "top_entropy", rho=0.4, scope=scope)
        ro.weight, counted = token_weights([top], ro, info_for(5))
        ro.set_extra("counted", counted, "token")
        assert ro.weight.tolist() == [[[1.0, 0.0, 1.0, 0.0, 0.0]]]
        obj = objective_for(
            [build("objective", "reinforce"), build("objective", "kl", coef=1.0, estimator="k2")], "token_mean"
        )
        logp = torch.full((1, 1, 5), -2.0)
        results[scope] = float(obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(5)), info_for(5)))
    assert results["loss"] == pytest.approx(1.3) and results["token"] == pytest.approx(2.5)
