"""Equivalences that must hold (DESIGN §6): Dr.GRPO = GRPO without std; GSPO on one-token
completions = PPO-clip; loss and gradient invariant to the micro-batch split."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import fill_needs, info_for, make_logp, make_rollout, objective_for

from groupwise.registry import build, names
from groupwise.types import Rollout, StepInfo


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dr_grpo_equals_grpo_without_std(seed):
    ro = make_rollout(5, 6, 3, seed=seed)
    dr = build("advantage", "dr_grpo")(ro, info_for(3))
    assert torch.equal(dr, build("advantage", "grpo", scale="none")(ro, info_for(3)))
    assert not torch.equal(dr, build("advantage", "grpo")(ro, info_for(3)))  # the std does matter


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28), (3e-4, 4e-4)])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "constant"])
def test_gspo_one_token_equals_ppo_clip(eps, agg):
    # T = 1 → the sequence ratio is the token ratio: s = exp(logp − logp_old), same clip, same loss and grad
    ro = make_rollout(4, 5, 1, seed=3, awkward=False)
    g = torch.Generator().manual_seed(0)
    base = ro.logp_old + 0.3 * torch.randn(ro.logp_old.shape, generator=g)  # ratios from 0.5 to 2: many clipped
    results = []
    for name in ("gspo", "ppo_clip"):
        logp = base.clone().requires_grad_(True)
        obj = objective_for([build("objective", name, eps_low=eps[0], eps_high=eps[1])], agg)
        loss = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info_for(1)), info_for(1))
        loss.backward()
        results.append(
            (
                loss.detach(),
                logp.grad,
                build("objective", name, eps_low=eps[0], eps_high=eps[1])(ro, {"logp": base}, info_for(1)),
            )
        )
    (l1, g1, v1), (l2, g2, v2) = results
    torch.testing.assert_close(v1, v2, atol=0, rtol=0)
    torch.testing.assert_close(l1, l2, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(g1, g2, atol=1e-7, rtol=1e-6)
    assert g1.abs().sum() > 0


@dataclass
class _RowTerm:
    """Test-only row-level term: −adv · mean_t(logp) per row, [b,G] (exercises row aggregation)."""

    coef: float = 0.5
    agg: str | None = None
    needs = ()
    token_weights = "row:geo_mean"  # token weights reach it as a per-row factor (objective.py), one row at a time

    def __call__(self, mb: Rollout, out: dict, info: StepInfo) -> torch.Tensor:
        m = mb.row_mask  # [b,G,T]
        logp = torch.where(m, out["logp"], torch.zeros(()))  # [b,G,T]
        return -mb.advantages * logp.sum(-1) / m.sum(-1).clamp(min=1)  # [b,G]


def _terms():
    return [
        build("objective", "ppo_clip", eps_high=0.28, dual_clip=3.0),
        build("objective", "gspo", eps_low=0.05, eps_high=0.05, agg="seq_mean_token_mean"),
        build("objective", "kl"),
        _RowTerm(),
    ]


@pytest.mark.parametrize("agg", names("aggregation"))
@pytest.mark.parametrize("with_weight", [False, True])
def test_micro_batching_invariance(agg, with_weight):
    B, G, T = 8, 4, 6
    ro = make_rollout(B, G, T, seed=5)
    terms = _terms()
    obj = objective_for(terms, agg)
    fill_needs(ro, obj.needs)
    if with_weight:
        w = build("weight", "top_entropy", rho=0.5)
        fill_needs(ro, w.needs)
        ro.weight = w(ro, info_for(T)) * build("weight", "mask_truncated")(ro, info_for(T))
    info = info_for(T)
    norms = obj.normalizers(ro, info)  # once, on the whole step batch

    logp = make_logp(ro)
    whole = obj.loss(ro, {"logp": logp}, norms, info)
    (grad_whole,) = torch.autograd.grad(whole, logp)

    logp2 = logp.detach().clone().requires_grad_(True)
    split = [[0, 5], [1], [2, 3, 7], [4, 6]]  # 4 micro-batches of whole groups, uneven, out of order
    total = sum(obj.loss(ro.select(idx), {"logp": logp2[idx]}, norms, info) for idx in split)
    total.backward()

    torch.testing.assert_close(total.detach(), whole.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logp2.grad, grad_whole, atol=1e-6, rtol=1e-6)
    assert grad_whole.abs().sum() > 0


def test_micro_batch_normalisers_would_differ():
    # guards the test above: normalising each micro-batch by itself gives a different loss
    B, G, T = 8, 4, 6
    ro = make_rollout(B, G, T, seed=5)
    obj = objective_for([build("objective", "ppo_clip")], "seq_mean_token_mean")
    info = info_for(T)
    logp = make_logp(ro)
    whole = obj.loss(ro, {"logp": logp}, obj.normalizers(ro, info), info)
    split = [[0, 5], [1], [2, 3, 7], [4, 6]]
    local = sum(obj.loss(ro.select(i), {"logp": logp[i]}, obj.normalizers(ro.select(i), info), info) for i in split)
    assert not torch.allclose(local, whole)
